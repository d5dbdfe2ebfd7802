"""tile_parts.py (this folder) on the code before the change, its softmax and value-sum lines as they were there:
run from the root of a checkout of 18c0e2c. usage: python PATH/tile_parts_before.py [N]"""

from pathlib import Path

src = (Path(__file__).parent / "tile_parts.py").read_text()
PAIRS = 'tile_softmax_pairs(ST, Mp, rv * 16, cn, c0, pos, "\n                         "masked, m, l, alpha, PP);'
src = src.replace(PAIRS, 'tile_softmax(ST, Mp, rv * 16, cn, c0, pos, masked, m, l, alpha);')
src = src.replace('"no softmax": (TILE, "  for', '"no softmax": (TILE, "    for')
PV = '"no value sums (PV)": (TILE, "  pv_rows_bf16(O, D, alpha + r0, PP + r0, Mp, VP, (cn + 1) / 2, Mp - r0);'
OLD_PV = '"no prob pairs and PV": (TILE, "      tile_values_bf16(O + r0 * D, D, alpha + r0, ST, Mp, r0, cn, PP, VP);'
src = src.replace(PV, OLD_PV)
exec(compile(src, "tile_parts.py", "exec"), {"__name__": "__main__"})
