"""Draw docs/packed-block.svg: one packed block row, a page in HND order, and what the
unfixed view of #47054 made of it. Run: python3 docs/make_packed_block_svg.py"""

from __future__ import annotations

from pathlib import Path

SLOTS, HEADS = 4, 2  # a small page: block_size 4, 2 KV heads (head_size elided)
CELL_W, CELL_H = 50, 34
LEFT = 30
HEAD_COLOURS = ["#cfe2ff", "#ffe5b4", "#d8f3dc", "#f8d7da"]


def text(
    x: float,
    y: float,
    s: str,
    size: int = 13,
    weight: str = "normal",
    anchor: str = "start",
    fill: str = "#222",
) -> str:
    return (
        f'<text x="{x}" y="{y}" font-size="{size}" font-weight="{weight}" '
        f'text-anchor="{anchor}" fill="{fill}">{s}</text>'
    )


def rect(
    x: float,
    y: float,
    w: float,
    h: float,
    fill: str,
    stroke: str = "#555",
    width: float = 1,
) -> str:
    return (
        f'<rect x="{x}" y="{y}" width="{w}" height="{h}" fill="{fill}" '
        f'stroke="{stroke}" stroke-width="{width}"/>'
    )


def block_row(y: int) -> list[str]:
    out = [
        text(
            LEFT,
            y,
            "1. One packed block row: three layers' pages, packing = "
            "(offset, block_stride)",
            15,
            "bold",
        )
    ]
    labels = [
        ("layer 0: sliding window", "offset 0"),
        ("layer 1: full attention", "offset 1 page"),
        ("layer 2: sliding window", "offset 2 pages"),
    ]
    for i, (name, offset) in enumerate(labels):
        x = LEFT + i * 270
        out.append(rect(x, y + 14, 260, 44, "#eef" if i != 1 else "#dde", width=1.5))
        out.append(text(x + 130, y + 34, name, 13, "bold", "middle"))
        out.append(text(x + 130, y + 51, offset, 12, anchor="middle"))
    return out


def page(y: int, title: str, label_of, truth_of) -> list[str]:
    """One page of 2 x SLOTS x HEADS cells in HND memory order, each labelled by
    LABEL_OF(c)."""
    out = [text(LEFT, y, title, 15, "bold")]
    per_half = SLOTS * HEADS
    for kv in range(2):
        x0 = LEFT + kv * (per_half * CELL_W + 20)
        out.append(
            text(
                x0 + per_half * CELL_W / 2,
                y + 20,
                "K" if kv == 0 else "V",
                13,
                "bold",
                "middle",
            )
        )
        for c in range(per_half):
            head, slot = truth_of(c)
            shown_head, shown_slot = label_of(c)
            wrong = (shown_head, shown_slot) != (head, slot)
            colour = HEAD_COLOURS[shown_head % len(HEAD_COLOURS)]
            out.append(
                rect(
                    x0 + c * CELL_W,
                    y + 28,
                    CELL_W,
                    CELL_H,
                    colour,
                    "#c00" if wrong else "#555",
                    2.5 if wrong else 1,
                )
            )
            out.append(
                text(
                    x0 + c * CELL_W + CELL_W / 2,
                    y + 50,
                    f"h{shown_head} s{shown_slot}",
                    12,
                    "bold" if wrong else "normal",
                    "middle",
                    "#c00" if wrong else "#222",
                )
            )
    return out


def main() -> None:
    # noqa: E731 - HND: head-major, then slot
    stored = lambda c: (c // SLOTS, c % SLOTS)
    # noqa: E731 - the view 0.25.1 hands the kernel
    unfixed = lambda c: (c // HEADS, c % HEADS)
    parts = block_row(30)
    parts += page(
        130,
        f"2. One layer's page in HND order (block_size {SLOTS}, {HEADS} KV heads)",
        stored,
        stored,
    )
    parts += [
        text(
            LEFT,
            212,
            "Fixed view (0.26.0 and this fork): shape [blocks, 2, block_size, heads, "
            "dim], strides in this order:",
            13,
        ),
        text(
            LEFT,
            229,
            "the kernel's (slot s, head h) reads exactly the cell labelled h s.",
            13,
        ),
    ]
    parts += page(
        262,
        "3. The view 0.24.0-0.25.1 build: .view(kv_cache_shape), then permute",
        unfixed,
        stored,
    )
    parts += [
        text(
            LEFT,
            344,
            f"Shape [blocks, 2, {HEADS}, {SLOTS}, dim]: FlashAttention "
            f"takes block_size = {HEADS} "
            f"and {SLOTS} KV heads; cells show what it reads as (h, s).",
            13,
        ),
        text(
            LEFT,
            362,
            "Red: another head's or slot's K/V. With real shapes the addresses run "
            "past the page:",
            13,
            fill="#c00",
        ),
        text(
            LEFT,
            379,
            'CUDA "illegal memory access" (vLLM issue #47054).',
            13,
            fill="#c00",
        ),
    ]
    width = LEFT * 2 + 2 * SLOTS * HEADS * CELL_W + 20
    svg = (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="395" '
        f'font-family="DejaVu Sans, Helvetica, Arial, sans-serif">\n'
        f"{rect(0, 0, width, 395, '#fff', '#fff')}\n" + "\n".join(parts) + "\n</svg>\n"
    )
    Path(__file__).with_name("packed-block.svg").write_text(svg)


if __name__ == "__main__":
    main()
