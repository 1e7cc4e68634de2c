"""Context parallelism: each sequence split over the cp ranks of a data-parallel replica, in
the causal load-balanced order (chunks i and 2·cp − 1 − i on cp rank i), attention by ring
exchange of key/value blocks (`runtime.ring_attention`).

Everything but attention is per token, so only three things change: the attention of every
block runs `runtime.ring_attention.ring_attention` over the cp group, the position embedding
reads the global positions of the local tokens, and the inputs and labels are sliced the same
way (`shard_sequence`). The cp ranks hold the same weights and reduce gradients together with
the dp ranks (`data_parallel_mesh`, dp·cp ranks: Megatron-LM's data-parallel-with-cp group).
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh

from runtime.model import Transformer
from runtime.ring_attention import load_balanced_indices

#: Name of the flattened dp × cp mesh dim that reduces gradients when cp > 1.
DP_CP = "dp_cp"


def cp_size(mesh: DeviceMesh) -> int:
    """The context-parallel degree of ``mesh`` (1 when it has no "cp" dim)."""
    return mesh["cp"].size() if "cp" in (mesh.mesh_dim_names or ()) else 1


def cp_rank(mesh: DeviceMesh) -> int:
    """This rank's coordinate on the "cp" dim of ``mesh`` (0 when it has none)."""
    return mesh["cp"].get_local_rank() if cp_size(mesh) > 1 else 0


def data_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D mesh whose ranks hold the same weights and average gradients: dp × cp flattened
    into one dim (adjacent in the mesh: `planner.mesh.mesh_dims` puts cp right inside dp) when
    the plan is context parallel, else dp. Collective on first use; later calls return the
    same mesh (``_flatten`` caches it by name, torchtitan's "dp_shard_cp" recipe)."""
    if cp_size(mesh) == 1:
        return mesh["dp"]
    return mesh["dp", "cp"]._flatten(DP_CP)


def apply_cp(model: Transformer, cp_mesh: DeviceMesh) -> Transformer:
    """Context parallelism of ``model`` (in place; a whole model or a pipeline stage).

    Every block's attention runs the ring over ``cp_mesh``'s group; the model's
    ``position_ids`` become this cp rank's global positions (`load_balanced_indices`, length
    seq_len / cp), which its position embedding reads.
    """
    group, rank = cp_mesh.get_group(), cp_mesh.get_local_rank()
    for block in model.layers.values():
        block = getattr(block, "_checkpoint_wrapped_module", block)
        block.attn.cp_group = group
    device = next(model.parameters()).device
    model.position_ids = load_balanced_indices(model.spec.seq_len, cp_mesh.size(), rank).to(device)
    return model
