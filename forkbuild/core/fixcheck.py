"""Does a piece of source carry the #47054 fix? Read with ast, not grep, so that
formatting and comments cannot fool it; reused for trees, installs and wheels."""

from __future__ import annotations

import ast
from typing import Literal

FUNCTION = "_reshape_attention_kv_cache"
MODULE_PATH = "vllm/v1/worker/gpu/attn_utils.py"
Verdict = Literal["fixed", "buggy", "unknown"]


def _is_packing_branch(test: ast.expr) -> bool:
    return (
        isinstance(test, ast.Compare)
        and isinstance(test.left, ast.Name)
        and test.left.id == "packing"
        and len(test.ops) == 1
        and isinstance(test.ops[0], ast.IsNot)
    )


def classify(source: str) -> Verdict:
    """The packed branch's view: permuted_kv_cache_shape 'fixed', kv_cache_shape
    'buggy', else 'unknown'."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return "unknown"
    for func in ast.walk(tree):
        if not (isinstance(func, ast.FunctionDef) and func.name == FUNCTION):
            continue
        for branch in ast.walk(func):
            if not (isinstance(branch, ast.If) and _is_packing_branch(branch.test)):
                continue
            viewed = {
                node.args[0].id
                for stmt in branch.body
                for node in ast.walk(stmt)
                if isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "view"
                and len(node.args) == 1
                and isinstance(node.args[0], ast.Name)
            }
            if "permuted_kv_cache_shape" in viewed:
                return "fixed"
            if "kv_cache_shape" in viewed:
                return "buggy"
    return "unknown"
