"""hetero.schema.trace: the Chrome Trace Event JSON of a timeline."""

from hetero.schema.trace import PID, Count, Span, chrome, memory_track


def test_lanes_become_named_threads_in_the_order_they_first_appear():
    spans = [Span("compute", "fp 0", 0.0, 0.002), Span("evict", "evict 0", 0.001, 0.0015, {"bytes": 4096}),
             Span("compute", "bp 0", 0.002, 0.005)]
    trace = chrome(spans, [Count(0.001, memory_track("dram"), {"activations": 4096})], {"plan": "p.yaml"})
    events = trace["traceEvents"]
    threads = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert threads == {0: "compute", 1: "evict"}
    assert all(e["pid"] == PID for e in events)
    assert (trace["displayTimeUnit"], trace["otherData"]) == ("ms", {"plan": "p.yaml"})


def test_spans_are_complete_events_in_microseconds_and_memory_a_counter_per_tier():
    trace = chrome([Span("evict", "evict 0", 0.001, 0.0015, {"bytes": 4096}), Span("compute", "fp 0", 0.0, 0.002)],
                   [Count(0.25, memory_track("nvme0"), {"activations": 10, "optimizer": 5})], {})
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [(e["name"], e["tid"], e["ts"], e["dur"]) for e in complete] == [
        ("evict 0", 0, 1000.0, 500.0), ("fp 0", 1, 0.0, 2000.0)]
    assert complete[0]["args"] == {"bytes": 4096} and "args" not in complete[1]
    counter = next(e for e in trace["traceEvents"] if e["ph"] == "C")
    assert (counter["name"], counter["ts"], counter["args"]) == ("memory nvme0", 250000.0,
                                                                 {"activations": 10, "optimizer": 5})
