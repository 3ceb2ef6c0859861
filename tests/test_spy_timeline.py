"""benchmarks/gpu/spy_timeline.py on a synthetic py-spy Chrome trace: stacks rebuilt from
begin/end events, spans labelled by the deepest listed function, bursts split at long
waits for input and told apart by whether a capture family routed in them."""
import gzip
import json

from benchmarks.gpu.spy_timeline import summary


def _trace(path, steps):
    """steps: (duration ms, stack root first) of the main thread, back to back."""
    events, ts, tid = [], 0, 7
    for ms, stack in steps:
        for name in stack:
            events.append({"ph": "B", "name": name, "ts": ts, "tid": tid, "pid": 1})
        ts += ms * 1000
        for name in reversed(stack):
            events.append({"ph": "E", "name": name, "ts": ts, "tid": tid, "pid": 1})
    events.append({"ph": "B", "name": "EngineCoreProc.run_busy_loop", "ts": ts, "tid": tid,
                   "pid": 1})  # the stack after the last step ends
    with gzip.open(path, "wt") as f:
        json.dump(events, f)


def test_bursts_by_kind_and_label(tmp_path):
    loop = ["EngineCoreProc.run_busy_loop"]
    wait = loop + ["EngineCoreProc._process_input_queue", "Queue.get"]
    execute = loop + ["Executor.execute_model"]
    prepare = execute + ["EngineHooks.prepare_step"]
    route = prepare + ["CaptureFamily.route"]
    device = loop + ["Future.result", "AsyncOutput.get_output", "Event.synchronize"]
    plain = [(3, execute), (1, prepare), (10, device)]
    capture = [(3, execute), (1, route), (2, prepare), (10, device)]
    _trace(tmp_path / "t.json.gz", [(20, wait)] + plain + [(20, wait)] + capture +
           [(20, wait)] + plain + [(20, wait)])
    got = summary(str(tmp_path / "t.json.gz"))
    assert got["plain"]["bursts"] == 2 and got["capture"]["bursts"] == 1
    assert got["plain"]["median_ms"] == {"execute": 3.0, "gt.prepare": 1.0,
                                         "wait_device": 10.0}
    assert got["capture"]["median_ms"] == {"execute": 3.0, "gt.prepare": 3.0,
                                           "wait_device": 10.0}
