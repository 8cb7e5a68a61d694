"""A /sys/class/infiniband tree in a temporary directory: the host's fabric counters where the tests mock sysfs."""


def ports(root, counts: dict[str, dict[str, int]]):
    """A /sys/class/infiniband tree: {"mlx5_0/1": {counter file: count}}."""
    for port, files in counts.items():
        device, number = port.split("/")
        counters = root / device / "ports" / number / "counters"
        counters.mkdir(parents=True, exist_ok=True)
        for name, count in files.items():
            (counters / name).write_text(f"{count}\n")
    return root
