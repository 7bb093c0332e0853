"""`elastic-moe bench --quick --only kappa`: the κ-draw table is produced, every cell is measured.

Times are measurements, not asserted (only finite, positive and ordered); the memory of `before`
is asserted to grow with the number of shards (it allocates num_shards·T fp64 uniforms), `after`'s
not to: that is the bytes the draws allocate, not a timing.
"""

import contextlib
import io
import json

from elastic_moe_plugin.cli import main
from elastic_moe_plugin.tools.bench import kappa


def _bench(*extra):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["bench", "--quick", "--only", "kappa", *extra]) == 0
    return out.getvalue()


def test_the_table_has_every_cell_and_after_allocates_o_of_t():
    report = json.loads(_bench("--json"))
    cells = {(c["sampling"], c["num_shards"], c["path"]): c for c in report["kappa_draw"]}
    assert set(cells) == {(s, n, p) for s in ("iid", "balanced") for n in kappa.QUICK_SHARDS for p in ("before", "after")}
    for cell in cells.values():
        assert 0 < cell["min_us"] <= cell["median_us"] <= cell["max_us"]
        assert cell["tokens"] == kappa.QUICK_TOKENS and cell["peak_bytes"] > 0
    for sampling in ("iid", "balanced"):
        one, eight = (cells[sampling, n, "before"]["peak_bytes"] for n in kappa.QUICK_SHARDS)
        # 7·T more fp64 uniforms, give or take the mapping's host temporaries (tens of bytes)
        assert eight - one >= 0.99 * 7 * 8 * kappa.QUICK_TOKENS
        one, eight = (cells[sampling, n, "after"]["peak_bytes"] for n in kappa.QUICK_SHARDS)
        assert abs(eight - one) < 8 * kappa.QUICK_TOKENS


def test_the_text_table_names_both_paths():
    text = _bench()
    assert "κ draw per router call, T=1024" in text
    assert len([line for line in text.splitlines() if line.startswith(("iid ", "balanced "))]) == 2 * len(kappa.QUICK_SHARDS)
