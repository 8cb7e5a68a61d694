"""PyTorch profiler (Kineto) traces as the tests read them."""


def kernels_by_step(doc: dict) -> tuple[list, dict, list, int, int]:
    """A trace's ProfilerStep windows (step, start, end), each launch's time by correlation id, its
    kernels, and the 1 µs grid they lie on (origin, size)."""
    events = doc["traceEvents"]
    windows = [
        (int(e["name"].split("#")[1]), e["ts"], e["ts"] + e["dur"])
        for e in events
        if e.get("cat") == "user_annotation" and e["name"].startswith("ProfilerStep#")
    ]
    launched = {e["args"]["correlation"]: e["ts"] for e in events if e.get("cat") == "cuda_runtime"}
    kernels = [e for e in events if e.get("cat") == "kernel"]
    origin = int(min(e["ts"] for e in kernels))
    return windows, launched, kernels, origin, int(max(e["ts"] + e["dur"] for e in kernels)) - origin + 1
