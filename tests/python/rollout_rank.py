"""One rollout rank for the Python tests: a numpy "engine" whose own arrays are ferry's storage.

Reports on stdout, one line per event: ready, paused <v> <mode> <clear_cache>, resumed <v>,
closed <v>. After every resume it saves its arrays to <out>/v<v>_rank<r>.npz. A pause for
version 99 raises, to test that a hook's exception fails the update. --resume-delay-s makes every
resume hook take that long (an update whose finish takes a while).
"""

import argparse
import json
import pathlib
import time

import numpy as np

import ferry

# numpy has no bf16 or f8: the engine holds their bits and labels them with ferry.view_as.
NUMPY_DTYPES = {"bf16": np.uint16, "f8_e4m3fn": np.uint8, "f32": np.float32}


def emit(*words):
    print(*words, flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--coordinator", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--config", required=True, help="LlamaConfig fields as JSON")
    ap.add_argument("--out", required=True)
    ap.add_argument("--resume-delay-s", type=float, default=0.0)
    args = ap.parse_args()
    out = pathlib.Path(args.out)

    spec = ferry.llama_rank_spec(ferry.LlamaConfig(**json.loads(args.config)), args.rank, args.tp, "fp8_per_tensor")
    layout = ferry.storage_tensors(spec)
    arrays = {t.name: np.zeros(t.shape, NUMPY_DTYPES[t.dtype]) for t in layout}
    storage = ferry.ModelStorage.wrap(spec, {t.name: ferry.view_as(arrays[t.name], t.dtype) for t in layout})
    addresses = {name: a.ctypes.data for name, a in arrays.items()}

    def check_identity():
        views = storage.tensors()
        assert views.keys() == arrays.keys()
        for name, a in arrays.items():
            assert a.ctypes.data == addresses[name], name
            assert views[name].data_ptr == addresses[name], name
            if views[name].dtype != "bf16":
                assert np.from_dlpack(views[name]).ctypes.data == addresses[name], name

    check_identity()

    def pause(request):
        if request.version == 99:
            raise ValueError("engine refuses version 99")
        emit("paused", request.version, request.mode, request.clear_cache)

    def resume(version):
        time.sleep(args.resume_delay_s)
        check_identity()
        np.savez(out / f"v{version}_rank{args.rank}.npz", **arrays)
        emit("resumed", version)

    with ferry.RolloutWorker(spec, storage, pause=pause, resume=resume, coordinator=args.coordinator) as worker:
        emit("ready")
        worker.serve()
        emit("closed", worker.weight_version)


if __name__ == "__main__":
    main()
