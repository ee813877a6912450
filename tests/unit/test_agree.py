"""The pure parts of the cross-rank agreement (``lightning_sp.comm.agree``): no process group."""

from __future__ import annotations

import subprocess
import sys

from lightning_sp.comm.agree import describe_disagreement, stable_hash


def _old_checksum(bounds):  # what the attention compared before: a position-weighted sum
    return sum((i + 1) * b for i, b in enumerate(bounds)) % (1 << 52)


def test_stable_hash_separates_documents_the_old_checksum_confused():
    good, bad = (0, 2, 8, 32), (0, 5, 6, 32)
    assert _old_checksum(good) == _old_checksum(bad)  # the collision the test below would have missed
    assert stable_hash(good) != stable_hash(bad)
    assert stable_hash(good) == stable_hash((0, 2, 8, 32))
    assert 0 <= stable_hash(good) < 2**48  # exact in the float64 row


def test_stable_hash_is_the_same_in_another_process():
    # Python's hash() of a str is salted per process; ranks are processes
    code = "from lightning_sp.comm.agree import stable_hash; print(stable_hash(('input_ids', (1,), 'torch.int64')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "random", **__import__("os").environ}).stdout
    assert int(out) == stable_hash(("input_ids", (1,), "torch.int64"))


def test_describe_disagreement_names_every_value_with_its_ranks():
    names = ("S_local", "dtype", "H")
    assert describe_disagreement([[4, 3, 8]] * 3, names, [0, 1, 2]) is None
    rows = [[4, 3, 8], [5, 3, 8], [4, 4, 8], [4, 3, 8]]
    text = describe_disagreement(rows, names, [10, 11, 12, 13], show={"dtype": lambda c: f"code{c}"})
    assert text.splitlines() == ["  S_local: 4 on ranks [10, 12, 13]; 5 on rank [11]",
                                 "  dtype: code3 on ranks [10, 11, 13]; code4 on rank [12]"]
