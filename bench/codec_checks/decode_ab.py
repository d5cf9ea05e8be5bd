"""Decoder.decode of requests: the decoder of run.sh's BASE (its directory is argv[1])
against the current one, in interleaved rounds."""
import sys, timeit, statistics
sys.path.insert(0, sys.argv[1])  # the old decoder.py, written there by run.sh
import old_decoder
from vllm_bridge.bridge.protocol.decoder import Decoder
from vllm_bridge.bridge.protocol import packb
from vllm_bridge.bridge.protocol.messages import peek_request_id
frames = {
  "add(1, 2)": packb(["call", 12345, None, 5000, ["m", "vllm_bridge.bridge.diag", "add"], [1, 2], {}]),
  "kwargs+map": packb(["call", 12345, "s", 5000, ["m", "vllm_bridge.bridge.diag", "echo"], [{"a": 1, "b": [1, 2, 3], "c": {"x": 1}}], {"k": 1, "j": 2}]),
  "1k ints": packb(["call", 1, None, 5000, ["m", "vllm_bridge.bridge.diag", "echo"], [list(range(1000))], {}]),
}
old, new = old_decoder.Decoder(), Decoder()
for name, f in frames.items():
    a, b = [], []
    for _ in range(7):  # interleaved rounds
        n = 20000 if name != "1k ints" else 2000
        a.append(timeit.timeit(lambda: old.decode(f), number=n) / n * 1e6)
        b.append(timeit.timeit(lambda: new.decode(f), number=n) / n * 1e6)
    print(f"{name:12s} old {statistics.median(a):.3f} us  new {statistics.median(b):.3f} us  (+{statistics.median(b)-statistics.median(a):.3f})")
n = 200000
print(f"peek_request_id {timeit.timeit(lambda: peek_request_id(frames['add(1, 2)']), number=n)/n*1e6:.3f} us (error path only)")
