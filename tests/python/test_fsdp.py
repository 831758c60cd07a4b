"""A sharded trainer from PyTorch itself: 2 trainer processes (gloo on CPU, fully_shard, FSDP2's
uneven Shard(0) rows) update a TP-2 replica of two rollout processes; every rank's storage is
compared bit for bit with the numpy reference. And ferry.dtensor_box against torch's own local
shapes and offsets on 2-D meshes (nested Shard, Replicate, empty chunks, Partial refused)."""

import json
import os
import pathlib
import socket
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")  # before ferry (fsdp_trainer.py says why)
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch without torch.distributed", allow_module_level=True)

import children  # noqa: E402
import ferry  # noqa: E402
import reference  # noqa: E402
from fsdp_trainer import CONFIG, make_weights  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
REF_CONFIG = dict(hidden=64, heads=4, kv_heads=2, inter=128, vocab=201, layers=2, pad=64)
TP = 2
TRAINERS = 2
VERSIONS = 2
TIMEOUT_S = 180


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_rank_storage(out, version, rank, weights):
    want = reference.expected_storage(REF_CONFIG, weights, rank, TP)
    children.check_saved_storage(out / f"v{version}_rank{rank}.npz", want, f"v{version} rank {rank}")


def test_fsdp2_trainer_ranks_update_a_replica_bit_exact(tmp_path):
    manifest = ferry.llama_manifest(ferry.LlamaConfig(**CONFIG))
    port = free_port()
    trainers, ranks = [], []
    try:
        for r in range(TRAINERS):
            env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(TRAINERS), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
            trainers.append(children.Child([sys.executable, str(HERE / "fsdp_trainer.py"), "--tp", str(TP),
                                            "--versions", str(VERSIONS)], TIMEOUT_S, env))
        boxes = [{} for _ in range(TRAINERS)]
        address = None
        while address is None:
            words = trainers[0].next()
            assert words[0] != "eof", "trainer rank 0 exited"
            if words[0] == "address":
                address = words[1]
            elif words[0] == "box":
                boxes[0][words[1]] = (json.loads(words[2]), json.loads(words[3]))
        for r in range(TP):
            ranks.append(children.rollout_rank(address, r, TP, CONFIG, tmp_path, TIMEOUT_S))
        for rank in ranks:
            rank.expect("ready")

        sent = [[] for _ in range(TRAINERS)]
        for t, proc in enumerate(trainers):
            for version in range(1, VERSIONS + 1):
                while True:
                    words = proc.next()
                    assert words[0] != "eof", f"trainer rank {t} exited before version {version}"
                    if words[0] == "box":
                        boxes[t][words[1]] = (json.loads(words[2]), json.loads(words[3]))
                        continue
                    assert words[:2] == ["done", str(version)]
                    sent[t].append(int(words[2]))
                    break
        for version in range(1, VERSIONS + 1):
            weights = make_weights(manifest, version)
            for r, rank in enumerate(ranks):
                rank.expect("paused", version, "abort", True)
                rank.expect("resumed", version)
                check_rank_storage(tmp_path, version, r, weights)

        # FSDP2's rows, as torch.chunk cuts them: 201 vocab rows are 101 then 100.
        for t in manifest:
            rows = t.shape[0]
            per = -(-rows // TRAINERS)
            for r in range(TRAINERS):
                start = min(r * per, rows)
                size = [min(per, rows - start)] + list(t.shape[1:])
                assert boxes[r][t.name] == ([start] + [0] * (len(t.shape) - 1), size), t.name
        assert boxes[1]["model.embed_tokens.weight"] == ([101, 0], [100, 64])
        # Every trainer rank reports the whole update's bytes.
        total = sum(int(np.prod(t.shape)) * 4 for t in manifest)
        assert sent[0] == sent[1] and all(b >= total for b in sent[0]), sent

        for t in trainers:
            assert t.next() == ["closed"]
            assert t.wait() == 0
        for rank in ranks:
            rank.expect("closed", VERSIONS)
            assert rank.wait() == 0
    finally:
        for p in trainers + ranks:
            p.kill()


# ferry.dtensor_box against torch on a 2x2 mesh of a fake process group: every rank's box, without
# processes. Uneven sizes leave some ranks empty chunks.
CASES = [
    ((7, 5), ("Shard(0)", "Shard(0)")),
    ((3, 4), ("Shard(0)", "Shard(0)")),
    ((5, 9), ("Shard(0)", "Shard(1)")),
    ((5, 9), ("Shard(1)", "Shard(0)")),
    ((9, 3), ("Replicate()", "Shard(0)")),
    ((1, 6), ("Shard(0)", "Replicate()")),
    ((4, 3, 5), ("Shard(2)", "Shard(-1)")),
    ((6,), ("Replicate()", "Replicate()")),
]


@pytest.fixture
def fake_world():
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")

    def init(rank, world):
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=rank, world_size=world)

    yield init
    if dist.is_initialized():
        dist.destroy_process_group()


def test_dtensor_box_matches_torch(fake_world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor  # noqa: F401

    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:
        compute_local_shape_and_global_offset = None
    for rank in range(4):
        fake_world(rank, 4)
        mesh = init_device_mesh("cpu", (2, 2))
        for shape, placements in CASES:
            kinds = dict(Shard=Shard, Replicate=Replicate)
            t = distribute_tensor(torch.zeros(shape), mesh,
                                  [kinds[p.split("(")[0]](*[int(d) for d in p[:-1].split("(")[1:] if d]) for p in placements])
            offset, size = ferry.dtensor_box(t, "w")
            assert size == list(t.to_local().shape), (rank, shape, placements)
            if compute_local_shape_and_global_offset is not None:
                local, off = compute_local_shape_and_global_offset(t.shape, mesh, t.placements)
                assert (size, offset) == (list(local), list(off)), (rank, shape, placements)
            # the holdings of such a state dict, and its manifest of global shapes
            sd = {"w": t, "b": torch.zeros(3)}
            m = ferry.manifest_from_state_dict(sd)
            assert [list(x.shape) for x in m] == [list(shape), [3]]
            assert m.holdings == {"w": [offset, size], "b": None}
        # Empty chunks: 3 rows on a 2x2 Shard(0), Shard(0) mesh leave the last rank none.
        t = distribute_tensor(torch.zeros(3, 4), mesh, [Shard(0), Shard(0)])
        assert ferry.dtensor_box(t) == ([[0, 0], [1, 0], [2, 0], [3, 0]][rank], [[1, 4], [1, 4], [1, 4], [0, 4]][rank])

        partial = torch.distributed.tensor.DTensor.from_local(torch.zeros(2, 2), mesh, [Replicate(), Partial()])
        with pytest.raises(ValueError, match="lm_head.weight.*partial"):
            ferry.holdings_from_state_dict({"lm_head.weight": partial})
        with pytest.raises(ValueError, match="lm_head.weight"):
            ferry.manifest_from_state_dict({"lm_head.weight": partial})


def test_plain_state_dicts_hold_everything_whole():
    sd = {"a": torch.zeros(4, 2), "b": np.zeros(3, np.float32)}
    m = ferry.manifest_from_state_dict(sd)
    assert m.holdings is None
    assert ferry.holdings_from_state_dict(sd) == {"a": None, "b": None}
    assert ferry.dtensor_box(sd["a"]) == ([0, 0], [4, 2])
