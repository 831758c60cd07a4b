"""
ferry: move fresh weights from an RL trainer into live rollout engines.
"""
# Type stubs of the _ferry extension: made by pybind11-stubgen (ferry._ferry), then edited by hand
# (Error, DLPack, container element types). tests/python/test_stubs.py checks that every public
# name of the module and of its classes is here; regenerate or edit when the bindings change.
from __future__ import annotations
import typing
__all__: list[str] = ['Error', 'LlamaConfig', 'ModelConfig', 'ModelDesc', 'ModelStorage', 'ParamSpec', 'PauseRequest', 'RankSpec', 'Region', 'RolloutWorker', 'SourceSlice', 'SourceTensor', 'StorageTensor', 'Tensor', 'Trainer', 'UpdateReport', 'describe_model', 'flush_logs', 'forward_logs', 'llama_manifest', 'llama_rank_spec', 'load_checkpoint', 'load_hf_config', 'log_forwarding', 'model_from_file', 'model_from_json', 'parse_hf_config', 'preset_model', 'preset_names', 'schemes', 'settings', 'storage_tensors', 'to_llama_config', 'view_as']
class Error(Exception):
    """
    A ferry failure: .code is the status code's name (InvalidArgument, NotFound, DeadlineExceeded, ...),
    .message the explanation.
    """
    code: str
    message: str
class _Borrowed:
    pass
class Tensor:
    """
    A view of memory ferry registered or allocated; exported by DLPack without a copy.
    """
    def __dlpack__(self, **kwargs) -> typing.Any:
        ...
    def __dlpack_device__(self) -> tuple[int, int]:
        ...
    def __repr__(self) -> str:
        ...
    def raw(self) -> Tensor:
        """
        The bytes as a 1-D u8 tensor (for consumers without bf16, e.g. numpy).
        """
    @property
    def data_ptr(self) -> int:
        ...
    @property
    def device(self) -> str:
        ...
    @property
    def dtype(self) -> str:
        ...
    @property
    def nbytes(self) -> int:
        ...
    @property
    def shape(self) -> tuple[int, ...]:
        ...
class SourceTensor:
    """
    One tensor of a manifest, in checkpoint format.
    """
    __hash__: typing.ClassVar[None] = None
    name: str
    shape: list[int]
    def __eq__(self, arg0: SourceTensor) -> bool:
        ...
    def __init__(self, name: str, dtype: typing.Any, shape: list[int]) -> None:
        ...
    def __repr__(self) -> str:
        ...
    @property
    def dtype(self) -> str:
        ...
    @dtype.setter
    def dtype(self, arg1: typing.Any) -> None:
        ...
class Region:
    offset: list[int]
    size: list[int]
    def __repr__(self) -> str:
        ...
class SourceSlice:
    """
    A region of a source tensor landing at dst_offset in a parameter.
    """
    dst_offset: list[int]
    source: str
    src: Region
class ParamSpec:
    """
    One full-precision parameter of a rank and its scheme.
    """
    layer: str
    name: str
    scheme: str
    shape: list[int]
    shard_rows: list[int]
    slices: list[SourceSlice]
    def __repr__(self) -> str:
        ...
    @property
    def source_dtype(self) -> str:
        ...
    @source_dtype.setter
    def source_dtype(self, arg1: typing.Any) -> None:
        ...
class RankSpec:
    """
    One rank of one replica: its parameters and the sources it takes.
    """
    ep_size: int
    expects: list[SourceTensor]
    layout: str
    params: list[ParamSpec]
    replica: int
    tp_rank: int
    tp_size: int
    def __repr__(self) -> str:
        ...
    def validate(self, arg0: typing.Any) -> None:
        ...
class ModelConfig:
    """
    A model's shape: a parsed config.json, or a Llama-family model.
    """
    decoder_sparse_step: int
    family: str
    head_dim: int
    hidden_size: int
    intermediate_size: int
    mlp_only_layers: list[int]
    moe_intermediate_size: int
    num_experts: int
    num_heads: int
    num_kv_heads: int
    num_layers: int
    qk_norm: bool
    qkv_bias: bool
    tie_word_embeddings: bool
    vocab_pad_multiple: int
    vocab_size: int
    def __init__(self, **kwargs: typing.Any) -> None:
        ...
    def validate(self, arg0: int) -> None:
        ...
    @property
    def dtype(self) -> str:
        ...
    @dtype.setter
    def dtype(self, arg1: typing.Any) -> None:
        ...
class ModelDesc:
    """
    A model as rules, from a preset, a config.json or a mapping file.
    """
    def manifest(self) -> list[SourceTensor]:
        ...
    def rank_spec(self, tp_rank: int, tp_size: int, scheme: str = 'none', ep_size: int = 1, replica: int = 0, layout: str = 'ferry') -> RankSpec:
        ...
    def stacked_experts(self) -> ModelDesc:
        """
        The same model with each layer's routed experts held stacked by the trainer, as transformers' fused experts hold them (mlp.experts.gate_up_proj [E, 2I, H], gate rows first; mlp.experts.down_proj [E, H, I]): its manifest names those tensors, and the plan cuts whole boxes of experts from them.
        """
    @property
    def name(self) -> str:
        ...
class StorageTensor:
    """
    One tensor of a rank's storage under its parameter's scheme.
    """
    def __repr__(self) -> str:
        ...
    @property
    def dtype(self) -> str:
        ...
    @property
    def name(self) -> str:
        ...
    @property
    def nbytes(self) -> int:
        ...
    @property
    def param(self) -> str:
        ...
    @property
    def runtime(self) -> bool:
        ...
    @property
    def shape(self) -> list[int]:
        ...
    @property
    def suffix(self) -> str:
        ...
class ModelStorage:
    """
    The tensors a rank's kernels read; their addresses never change.
    """
    @staticmethod
    def allocate(spec: RankSpec, device: typing.Any = 'cpu', none_dtype: typing.Any = 'bf16') -> ModelStorage:
        """
        Zeroed storage allocated by ferry; hand its tensors() to the engine by DLPack.
        """
    @staticmethod
    def wrap(spec: RankSpec, tensors: typing.Any, none_dtype: typing.Any = 'bf16', strict: bool = True) -> ModelStorage:
        """
        Storage over the engine's own tensors (a mapping or (name, tensor) pairs, by storage name), without copies. Every storage tensor of the spec must be given; f8 and packed int4 storage may be given as u8 of the same bytes. With strict=False, other names are ignored.
        """
    def __len__(self) -> int:
        ...
    def __repr__(self) -> str:
        ...
    def get(self, name: str) -> Tensor:
        ...
    def tensors(self) -> dict[str, Tensor]:
        """
        name -> ferry.Tensor (DLPack) of every registered tensor.
        """
    @property
    def bytes(self) -> int:
        ...
    @property
    def device(self) -> str:
        ...
class UpdateReport:
    """
    What finish_weight_update() measured.
    """
    def __repr__(self) -> str:
        ...
    def as_dict(self) -> dict[str, typing.Any]:
        ...
    @property
    def allocated_staging_bytes(self) -> int:
        """
        host staging and scratch the ranks allocated anew, summed (0 while updates keep their shape)
        """
    @property
    def bytes(self) -> int:
        ...
    @property
    def gbps(self) -> float:
        ...
    @property
    def moved(self) -> int:
        ...
    @property
    def pause_seconds(self) -> float:
        ...
    @property
    def pause_window_seconds(self) -> float:
        """
        the longest time a replica did not serve (staged: its apply)
        """
    @property
    def staged(self) -> bool:
        ...
    @property
    def apply_seconds(self) -> float:
        """
        staged: the longest apply of a replica
        """
    @property
    def delta_copy_bytes(self) -> int:
        """
        memory (host, or device: FERRY_DELTA_COPY) this trainer keeps to compute deltas against
        """
    @property
    def shadow_bytes(self) -> int:
        """
        memory the ranks keep as delta shadows, host or device (FERRY_DELTA_SHADOW), summed
        """
    @property
    def compared_bytes(self) -> int:
        """
        bytes this trainer compared against its copies: each part once, however many replicas take it
        """
    @property
    def compare_seconds(self) -> float:
        """
        this trainer's time comparing and encoding deltas (each part once)
        """
    @property
    def copy_seconds(self) -> float:
        """
        this trainer's time keeping its copies of the tensors sent, which the next update compares against
        """
    @property
    def wire_bytes(self) -> int:
        """
        payload bytes this trainer sent, over ranks
        """
    @property
    def delta_bytes(self) -> int:
        """
        of wire_bytes, the delta pieces' encodings
        """
    @property
    def changed_fraction(self) -> float:
        """
        of the elements compared against the version a rank held, the fraction that changed
        """
    @property
    def peak_staging_bytes(self) -> int:
        ...
    @property
    def plan_seconds(self) -> float:
        ...
    @property
    def process_seconds(self) -> float:
        ...
    @property
    def ranks(self) -> int:
        ...
    @property
    def registered(self) -> int:
        ...
    @property
    def resume_seconds(self) -> float:
        ...
    @property
    def seconds(self) -> float:
        ...
    @property
    def transfer_seconds(self) -> float:
        ...
    @property
    def version(self) -> int:
        ...
class PauseRequest:
    """
    What the pause hook is told.
    """
    def __repr__(self) -> str:
        ...
    @property
    def clear_cache(self) -> bool:
        ...
    @property
    def mode(self) -> str:
        ...
    @property
    def version(self) -> int:
        ...
class Trainer:
    """
    The trainer side: start_weight_update, send, finish_weight_update.
    """
    def __enter__(self) -> Trainer:
        ...
    def __exit__(self, *args: typing.Any) -> None:
        ...
    def __init__(self, coordinator: str = '', port: int = 0, pause_mode: str = 'abort', clear_cache: bool = True, trainer_rank: int = 0, trainer_ranks: int = 1, **kwargs: typing.Any) -> None:
        """
        Joins `coordinator` (host:port), or embeds one when it is empty (on listen_host and `port`). A sharded trainer is trainer_rank of trainer_ranks processes joining one coordinator (one of them may embed it; ferry.distributed_trainer() does that for a torch.distributed job); updates are then collective over them. Every other keyword is a setting, FERRY_* lower-cased without FERRY_ (bucket_bytes='64M', timeout_ms=5000, transport='tcp', ...), and beats the environment; .settings shows each value and its source.
        """
    def abort_weight_update(self, reason: str = 'aborted by the trainer') -> None:
        """
        Ends the open update without finishing it (after a failed send, say): the ranks stay paused and inconsistent, or roll back with FERRY_ROLLBACK=host. Raises when no update is open.
        """
    def close(self) -> None:
        """
        Stops the trainer (and its embedded coordinator); ranks see the job end.
        """
    def finish_weight_update(self) -> UpdateReport:
        """
        Waits until every rank holds the version, resumes them together, and returns the UpdateReport.
        """
    def send(self, name: str, tensor: typing.Any) -> None:
        """
        Sends one tensor of the manifest (torch, numpy, any DLPack tensor): the held box of it, a DTensor's to_local().
        """
    def start_weight_update(self, version: int, manifest: typing.Any, pause_mode: str | None = None, clear_cache: bool | None = None, replicas: list[int] | None = None, holdings: typing.Any = None, stage: bool = False, source_layout: SourceLayout | None = None) -> None:
        """
        Checks the manifest against every replica, pauses them and plans. Manifest: SourceTensor objects or (name, dtype, shape) tuples, global shapes. holdings: what this trainer rank holds, {name: None (whole) | (offset, size) box of the global tensor}, names left out not held (see ferry.holdings_from_state_dict); None: the manifest's .holdings if it has them, else every tensor whole. With several trainer ranks, every one starts the update (collective).
        """
    def update_weights(self, weights: typing.Any) -> None:
        """
        Sends every tensor this trainer rank holds: a mapping is read in plan order, and asked only for held tensors; an iterable of (name, tensor) pairs (e.g. model.state_dict().items() or a generator) is sent as it comes. DTensor values send their to_local(), never a gathered full_tensor().
        """
    def wait_for_ranks(self, n: int, timeout_ms: int = 30000) -> None:
        ...
    @property
    def coordinator_address(self) -> str:
        ...
    @property
    def settings(self) -> dict[str, tuple[typing.Any, str]]:
        """
        {keyword: (value, source)}: the settings this trainer took, source 'keyword', 'environment' or 'default'.
        """
class RolloutWorker:
    """
    A rollout rank: registers its storage and serves updates.
    """
    def __enter__(self) -> RolloutWorker:
        ...
    def __exit__(self, *args: typing.Any) -> None:
        ...
    def __init__(self, spec: RankSpec, storage: ModelStorage, pause: typing.Callable[[PauseRequest], None] | None = None, resume: typing.Callable[[int], None] | None = None, **kwargs: typing.Any) -> None:
        """
        Joins the coordinator (keyword coordinator='host:port', else FERRY_COORDINATOR) and serves updates on background threads. pause(request) runs before any byte of an update is written; resume(version) once every rank of the replica holds it. Both run on ferry's threads; an exception fails the update. Every other keyword is a setting too (timeout_ms=5000, verify=True, rollback='host', ...) and beats the environment; .settings shows each value and its source.
        """
    def close(self) -> None:
        ...
    def resume(self) -> None:
        """
        Runs the resume hook again after it failed at the end of an update; the replica serves again once it succeeds.
        """
    def serve(self, timeout_ms: int | None = None) -> None:
        """
        Serves updates until the coordinator ends the job (or timeout_ms passes: DeadlineExceeded). Raises when the coordinator was lost instead, saying the state it left this rank in.
        """
    def wait_closed(self, timeout_ms: int) -> None:
        ...
    def wait_serving(self, timeout_ms: int = 30000) -> None:
        ...
    @property
    def consistent(self) -> bool:
        ...
    @property
    def paused(self) -> bool:
        ...
    @property
    def settings(self) -> dict[str, tuple[typing.Any, str]]:
        """
        {keyword: (value, source)}: the settings this rank took, source 'keyword', 'environment' or 'default'.
        """
    @property
    def storage(self) -> ModelStorage:
        ...
    @property
    def weight_version(self) -> int:
        ...
def describe_model(arg0: ModelConfig) -> ModelDesc:
    ...
def flush_logs(timeout_s: float = 5.0) -> bool:
    """
    Waits until every ferry log record made before the call has been handed to logging (True), or timeout_s passed (False).
    """
def forward_logs(enabled: bool = True) -> None:
    """
    Whether ferry's log records go to Python's logging, logger 'ferry' (the default from import on), or to stderr as the C++ library writes them ('[ferry] [warning] ...'). Levels map to DEBUG, INFO, WARNING, ERROR and CRITICAL, trace to 5. FERRY_LOG_LEVEL (warn unless set) still decides which records ferry makes; the 'ferry' logger's level and handlers decide where they go. Records reach logging from a thread of ferry's, soon after they are made; flush_logs() waits for them.
    """
class SourceLayout:
    """
    Where a trainer rank's boxes of the checkpoint tensors lie in its own fused local tensors: pass it to Trainer.start_weight_update(source_layout=...) and send the local tensors under their own names.
    """
    def __len__(self) -> int:
        ...
    @property
    def boxes(self) -> list[tuple[str, list[int], list[int], str, int]]:
        """
        (checkpoint tensor, box offset, box size, local tensor, the box's first row there), one per box
        """
def megatron_layout(config: ModelConfig, rank: int, ranks: int, *, tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None) -> SourceLayout:
    """
    Megatron-Core's fused tensors of trainer rank `rank` of `ranks` (its default order tp-cp-ep-dp-pp; TP tp, pp pipeline stages, EP ep, expert TP etp, tp when None): linear_qkv per query group, [gate; up] linear_fc1, row-parallel linear_proj / linear_fc2, grouped experts' linear_fc1.weight{i} / linear_fc2.weight{i}, the vocabulary padded as Megatron pads it.
    """
def llama_manifest(arg0: ModelConfig) -> list[SourceTensor]:
    """
    Every tensor a trainer sends for this model.
    """
def llama_rank_spec(config: ModelConfig, tp_rank: int, tp_size: int, scheme: str = 'none', replica: int = 0, layout: str = 'ferry') -> RankSpec:
    ...
def load_checkpoint(spec: RankSpec, storage: ModelStorage, tensors: typing.Any, version: int = 1) -> dict:
    """
    Loads a checkpoint held in host memory (name -> tensor) into the rank's storage in place, as an update would, without a trainer: a first load, or a quantized checkpoint (gptq_int4, whose inputs are named after the engine parameter with their suffix: '...qkv_proj.qweight', '.scales', '.g_idx'). Returns {'bytes', 'layers', 'moved', 'registered'}; moved is the census (0: no registered tensor moved). A load that fails (a tensor missing, a bad g_idx) may leave the layers before it, and rows of the one it stopped in, written; never load into storage a RolloutWorker is serving.
    """
def load_hf_config(arg0: str) -> ModelConfig:
    ...
def log_forwarding() -> bool:
    """
    True while ferry's log records go to Python's logging (forward_logs()).
    """
def model_from_file(arg0: str) -> ModelDesc:
    ...
def model_from_json(arg0: str) -> ModelDesc:
    ...
def parse_hf_config(arg0: str) -> ModelConfig:
    ...
def preset_model(arg0: str) -> ModelDesc:
    ...
def preset_names() -> list[str]:
    ...
def schemes() -> list[str]:
    ...
def settings(**kwargs: typing.Any) -> dict[str, tuple[typing.Any, str]]:
    """
    Every setting as a Trainer or RolloutWorker given these keywords would take it: {keyword: (value, source)}, source 'keyword', 'environment' (FERRY_<KEYWORD>) or 'default'. Keywords are the FERRY_* names lower-cased without FERRY_ (bucket_bytes='64M', timeout_ms=5000, transport='tcp', verify=True).
    """
def storage_tensors(spec: RankSpec, none_dtype: typing.Any = 'bf16') -> list[StorageTensor]:
    """
    Every tensor the rank's storage holds (weights, scales, runtime tensors), in registration order.
    """
def to_llama_config(arg0: ModelConfig) -> ModelConfig:
    ...
def view_as(tensor: typing.Any, dtype: typing.Any) -> Tensor:
    """
    The same memory as a ferry.Tensor of `dtype` (same element width): e.g. a numpy uint16 array as bf16, or uint8 as f8_e4m3fn. No copy.
    """
__version__: str
LlamaConfig = ModelConfig
