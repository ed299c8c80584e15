"""The metrics writer: the same scalars in metrics.jsonl and TensorBoard, without loading torch."""

import json
import struct
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

_SCRIPT = """
import importlib.util, json, sys
from jaxllm.metrics import MetricsWriter

w = MetricsWriter(sys.argv[1])
w.write(3, {"loss": 2.5, "lr": 1e-3, "note": "text is not a scalar"})
w.write(4, {"loss": float("nan")})
w.close()
torch_installed = importlib.util.find_spec("torch") is not None
loaded = "torch" in sys.modules
if torch_installed:
    import torch  # the writer left `import torch` working
print(json.dumps({"installed": torch_installed, "loaded": loaded, "entry": "torch" in sys.modules}))
"""


def _scalars(event_file: Path) -> list[tuple[int, str, float]]:
    """(step, tag, value) of every scalar in a TFRecord file of TensorBoard events."""
    from tensorboardX.proto import event_pb2

    data, out, i = event_file.read_bytes(), [], 0
    while i < len(data):
        (n,) = struct.unpack("<Q", data[i : i + 8])
        event = event_pb2.Event.FromString(data[i + 12 : i + 12 + n])
        i += 12 + n + 4  # length, its crc, the record, its crc
        out += [(event.step, v.tag, v.simple_value) for v in event.summary.value]
    return out


def test_scalars_reach_jsonl_and_tensorboard_and_torch_is_not_loaded(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.splitlines()[-1])
    assert not seen["loaded"]  # tensorboardX would import it, costing seconds at every start
    assert seen["entry"] == seen["installed"]  # and a later `import torch` still works

    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0] == {"step": 3, "loss": 2.5, "lr": 1e-3, "note": "text is not a scalar"}
    assert rows[1]["step"] == 4
    (events,) = (tmp_path / "tensorboard").glob("events.out.tfevents.*")
    scalars = {(step, tag): value for step, tag, value in _scalars(events)}
    assert scalars.keys() == {(3, "loss"), (3, "lr")}  # the text and the NaN are left out
    assert scalars[3, "loss"] == 2.5
    assert abs(scalars[3, "lr"] - 1e-3) < 1e-9  # float32 in the event
