"""Which DeviceMesh dimension a process group stands for (dp, tp, pp, ...: the names the job gave its
mesh), for each collective's `rankwatch.comm.role`. torch describes a group it made for one dimension
of a mesh as `mesh_<name>`; a dimension spanning every rank reuses the default group, which names no
mesh, so the groups a mesh hands out (`DeviceMesh.get_group`, wrapped by `watch`) are noted as they
are asked for. Light: torch is imported only by `watch`, which zero-code instrumentation calls as
torch is imported, before any mesh is made.
"""

import functools

_ROLES: dict = {}  # process group -> the mesh dimension it was handed out for


def role(group) -> str | None:
    """The DeviceMesh dimension `group` stands for, or None where no mesh names it."""
    desc = str(getattr(group, "group_desc", "") or "")
    return desc.removeprefix("mesh_") if desc.startswith("mesh_") else _ROLES.get(group)


def watch() -> None:
    """From now on, note the dimension of each group a DeviceMesh hands out."""
    from torch.distributed.device_mesh import DeviceMesh

    get_group = DeviceMesh.get_group
    if getattr(get_group, "__rankwatch__", False):
        return

    @functools.wraps(get_group)
    def noted(self, mesh_dim=None):
        group = get_group(self, mesh_dim)
        names = self.mesh_dim_names
        if names:
            _ROLES[group] = mesh_dim if isinstance(mesh_dim, str) else names[mesh_dim or 0]
        return group

    noted.__rankwatch__ = True  # type: ignore[attr-defined]  # marks the wrapper, for unwatch
    DeviceMesh.get_group = noted  # type: ignore[method-assign]


def unwatch() -> None:
    """Put DeviceMesh.get_group back."""
    from torch.distributed.device_mesh import DeviceMesh

    if getattr(DeviceMesh.get_group, "__rankwatch__", False):
        DeviceMesh.get_group = DeviceMesh.get_group.__wrapped__  # type: ignore[attr-defined,method-assign]
