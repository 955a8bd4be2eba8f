"""Does source carry the #47054 fix? Read with ast, not grep: layout cannot fool it."""

import ast
from typing import Literal

FUNCTION = "_reshape_attention_kv_cache"
MODULE_PATH = "vllm/v1/worker/gpu/attn_utils.py"
Verdict = Literal["fixed", "buggy", "unknown"]


def _is_packing_branch(node: ast.AST) -> bool:  # `if packing is not ...:`
    match node:
        case ast.If(test=ast.Compare(left=ast.Name(id="packing"), ops=[ast.IsNot()])):
            return True
    return False


def _viewed(node: ast.AST) -> str | None:  # NAME of `....view(NAME)`
    match node:
        case ast.Call(func=ast.Attribute(attr="view"), args=[ast.Name(id=name)]):
            return name
    return None


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
        for branch in filter(_is_packing_branch, ast.walk(func)):
            viewed = {_viewed(n) for stmt in branch.body for n in ast.walk(stmt)}
            if "permuted_kv_cache_shape" in viewed:
                return "fixed"
            if "kv_cache_shape" in viewed:
                return "buggy"
    return "unknown"
