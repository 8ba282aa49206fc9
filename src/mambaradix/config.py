"""Typed configuration. The command line is generated from these dataclasses' fields.

Flag names follow SGLang's where the meaning is the same: field ``page_size`` is
``--page-size``; a bool field that defaults to False is a store-true flag. Each field's
``metadata["help"]`` is its help text; ``metadata["choices"]`` restricts its values.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, TypeVar

from mambaradix.core import STRATEGIES
from mambaradix.kernels.backend import backend_names

T = TypeVar("T")


def opt(default: Any, help: str, choices: list[str] | None = None) -> Any:
    meta: dict[str, Any] = {"help": help}
    if choices:
        meta["choices"] = choices
    return field(default=default, metadata=meta)


@dataclass
class EngineConfig:
    model_path: str = opt(
        "", "Local Hugging Face checkpoint folder (or 'tiny:<arch>' for a built-in tiny model)."
    )
    dtype: str = opt(
        "auto",
        "Weight and activation dtype; 'auto' takes the checkpoint's (config.json 'dtype' / "
        "'torch_dtype'; float32 when it names none), a bf16 one in float32 on a CPU where "
        "neither the CPU (AVX512-BF16 / AMX) nor the kernel backend computes bf16 fast.",
        ["auto", "float32", "bfloat16", "float16"],
    )
    quantization: str = opt(
        "",
        "Weight quantization: 'fp8' stores the linears' weights as float8 e4m3 with a "
        "power-of-two scale per 128 x 128 block, quantized as they load; activations stay in "
        "--dtype (W8A16). The routed experts' stacks too, expert by expert; the LM head and "
        "MoE routers keep --dtype. Decode reads about half the bytes; outputs move by fp8 "
        "rounding from the checkpoint's, and never depend on the cache. 'none': the weights "
        "as --dtype. Default: the checkpoint's "
        "(a block-FP8 checkpoint, quantization_config quant_method fp8 with 128 x 128 blocks, "
        "loads as fp8: dequantized as read and quantized again to power-of-two scales; any "
        "other checkpoint as --dtype).",
        ["", "fp8", "none"],
    )
    device: str = opt("cpu", "Torch device.")
    seed: int = opt(
        0,
        "Seed for model init of tiny models and for sampling without a per-request seed (each "
        "such request draws its own seed from it, in arrival order).",
    )
    context_length: int = opt(0, "Maximum sequence length; 0 takes the checkpoint's.")
    page_size: int = opt(1, "KV slots per page; the radix tree caches whole pages.")
    chunked_prefill_size: int = opt(
        0,
        "Max prompt tokens computed per request per forward; -1 disables chunking; 0 "
        "(default): 512 on a CPU device, on a CUDA device by its memory as SGLang sizes it "
        "(2048 under 35 GiB, 8192 under 160 GiB: H100, H200; else 16384).",
    )
    max_prefill_tokens: int = opt(
        0,
        "Max new tokens in one forward (prefill + decode); 0 (default): 4096 on a CPU device, "
        "16384 on a CUDA device (SGLang's), and at least --chunked-prefill-size.",
    )
    max_running_requests: int = opt(
        0, "Cap on running requests; 0 derives it from the state slots."
    )
    max_total_tokens: int = opt(0, "KV pool size in tokens; 0 sizes it from --mem-budget-gb.")
    mem_budget_gb: float = opt(
        0.0,
        "Memory for KV + state pools when not sized explicitly; 0 takes "
        "--mem-fraction-static of the memory free after loading.",
    )
    mem_fraction_static: float = opt(
        0.5,
        "Share of the memory available after loading the weights (MemAvailable on the CPU, "
        "free device memory on a GPU) given to the KV + state pools when --mem-budget-gb is 0.",
    )
    max_mamba_cache_size: int = opt(
        0, "State pool size in slots; 0 splits the budget by --mamba-full-memory-ratio."
    )
    mamba_full_memory_ratio: float = opt(
        0.5, "State bytes : KV bytes when splitting the memory budget."
    )
    mamba_ssm_dtype: str = opt(
        "float32",
        "Dtype of the temporal (SSM / delta-rule) state.",
        ["float32", "bfloat16", "float16"],
    )
    mamba_scheduler_strategy: str = opt(
        "auto", "How snapshots move into the tree.", ["auto", *STRATEGIES]
    )
    mamba_track_interval: int = opt(256, "Snapshot every N decode tokens.")
    state_eviction_policy: str = opt(
        "value",
        "Which cached state snapshot goes first when the state pool is full; both keep branch "
        "points and the states waiting requests expect until the rest is gone. 'value': the "
        "fewest prefix tokens saved first (a state with a deeper one below it saves nothing "
        "more), aged as others come and go: keeps long conversations and documents over short "
        "ones; 'lru': the least recently used first.",
        ["lru", "value"],  # cache/evict_policy.STATE_POLICIES (config sits below cache/)
    )
    disable_radix_cache: bool = opt(
        False, "Run without prefix caching (same engine, everything freed at finish)."
    )
    enable_hierarchical_cache: bool = opt(
        False,
        "Add a storage tier under the RAM pools: evicted prefixes (KV pages and state "
        "snapshots) are written to storage and loaded back when a request matches them, by "
        "content key, so they survive restarts and are shared by every process using the same "
        "storage (on by default for serve --dp-size > 1).",
    )
    hicache_storage_backend: str = opt(
        "file",
        "Storage tier backend: 'file' (one directory, --hicache-storage-dir) or 'redis' "
        "(--hicache-storage-url).",
        ["file", "redis"],
    )
    hicache_storage_dir: str = opt(
        "",
        "Directory of the file storage tier; '' takes ~/.cache/mambaradix/hicache. Processes "
        "serving the same model share what they store there.",
    )
    hicache_storage_url: str = opt(
        "", "Redis URL of the redis storage tier; '' takes redis://127.0.0.1:6379/0."
    )
    hicache_write_policy: str = opt(
        "write_back",
        "When prefixes reach storage: 'write_back' (when the RAM tier evicts them, and at "
        "shutdown: nothing is written while everything fits in RAM), 'write_through' (every "
        "snapshot the tree keeps, as it is inserted: survives a crash, costs the copies and "
        "the disk writes of every snapshot), 'write_through_selective' (a snapshot once a "
        "request resumes from it: the prefixes used twice).",
        ["write_back", "write_through", "write_through_selective"],
    )
    hicache_size: float = opt(
        0.0, "Bound of the storage tier in GB (least recently used objects go first); 0: none."
    )
    schedule_policy: str = opt("fcfs", "Order of the waiting queue.", ["fcfs", "lpm"])
    skip_warmup: bool = opt(
        False,
        "Skip the warm-up forward at start (one batch of --max-prefill-tokens on scratch slots, "
        "so the first requests do not pay for growing the CPU allocator's heap).",
    )
    debug_integrity: bool = opt(
        False,
        "Run the full integrity check (every KV and state slot, request and lock accounted "
        "for; the tree's invariants) after every engine step. Slow: for tests and debugging.",
    )
    disable_overlap_schedule: bool = opt(
        False, "Prepare the next batch only after the current one finished."
    )
    watchdog_timeout: float = opt(
        300.0,
        "Seconds a forward may run with work pending before /health reports the engine stuck "
        "(503).",
    )
    disable_decode_graph: bool = opt(
        False,
        "Run every decode step through the model's Python forward instead of replaying the "
        "step recorded for its batch size (as SGLang's --disable-cuda-graph).",
    )
    decode_graph_max_bs: int = opt(
        16,
        "Largest decode batch whose steps are recorded and replayed (as --cuda-graph-max-bs): "
        "the Python a replay saves is the same at any batch, a smaller share of larger steps, "
        "and each recorded step holds its batch's activations and logits.",
    )
    disable_cuda_graph: bool = opt(
        False,
        "Run every decode step eagerly instead of replaying its CUDA graph (on a CPU device: "
        "its recorded step, as --disable-decode-graph).",
    )
    cuda_graph_max_bs: int = opt(
        256,
        "On a CUDA device, the largest decode batch captured as a CUDA graph (larger batches "
        "run eagerly); the captured sizes are 1, 2, 4, 8, then every 8 (SGLang's buckets).",
    )
    cuda_graph_bs: tuple[int, ...] = opt(
        (),
        "On a CUDA device, the decode batch sizes captured as CUDA graphs (a step pads to the "
        "next one), replacing the buckets --cuda-graph-max-bs gives.",
    )
    speculative_algorithm: str = opt(
        "",
        "Speculative decoding: each decoding request's next k tokens are drafted and verified "
        "in one forward; the outputs are those of decoding without it (greedy: the same "
        "tokens; sampling: the same distribution, with a seed the same tokens). 'NGRAM' "
        "drafts from the request's own prompt and output (prompt lookup); 'NEXTN' / 'MTP' "
        "(one name) chain the checkpoint's multi-token-prediction head (Qwen3-Next / Qwen3.5 "
        "checkpoints with mtp.* weights). Turns overlap off.",
        ["", "NGRAM", "NEXTN", "MTP"],
    )
    speculative_num_steps: int = opt(3, "Draft tokens per verify step (k).")
    speculative_num_draft_tokens: int = opt(
        0, "Tokens a verify step scores: k + 1 with --speculative-eagle-topk 1 (0: k + 1)."
    )
    speculative_eagle_topk: int = opt(1, "Draft branches per step; only 1 (a chain) is supported.")
    speculative_ngram_min_match_window_size: int = opt(
        1, "NGRAM: the shortest suffix of a request's tokens looked up in its earlier tokens."
    )
    speculative_ngram_max_match_window_size: int = opt(
        4, "NGRAM: the longest suffix looked up (the longest that matches wins)."
    )
    speculative_disable_by_batch_size: int = opt(
        0,
        "A step with more decoding requests than this drafts nothing (each decodes one token), "
        "where the products of k + 1 rows a request outweigh reading the weights once: on a "
        "2-core AVX2 CPU, NGRAM at k = 3 with nearly every draft kept gave 1.1x at 8 requests, "
        "0.95x at 16 (docs/benchmarks.md). Outputs do not change (greedy: the same tokens; "
        "seeded sampling: the same draws). 0: never.",
    )
    speculative_adaptive: bool = opt(
        False,
        "Each step verifies at most as many draft tokens (0 to k, one cap for the step) as pay "
        "on this machine: the cap that maximises the expected tokens per second, from the "
        "step times measured for each batch size and row count and each request's recent "
        "accept rate; at cap 0, one step in 32 verifies one token to see whether drafts pay "
        "again (engine/spec_policy.py). Outputs do not change, as with any cap.",
    )
    speculative_adaptive_costs: str = opt(
        "",
        "Where --speculative-adaptive keeps the step costs it measured, read at start and "
        "written at shutdown, so that a restarted engine on the same machine, model and "
        "settings starts from them instead of measuring again (a JSON file; one measured for "
        "anything else, or unreadable, is ignored). '' takes "
        "~/.cache/mambaradix/spec-costs/<digest of those>.json; 'none' keeps nothing.",
    )
    speculative_token_map: str = opt(
        "",
        "NEXTN / MTP: a JSON file listing the token ids the head drafts from (a hot "
        "vocabulary, as SGLang's FR-Spec token maps): a draft step computes those logits only, "
        "reading that many rows of lm_head instead of the whole vocabulary. Outputs stay "
        "those of decoding without speculation; only which drafts are possible changes.",
    )
    num_threads: int = opt(0, "torch intra-op threads; 0 keeps torch's default.")
    kernel_backend: str = opt(
        "auto",
        "Kernels: 'cpu' adds native C kernels for the decode hot spots (built on first use "
        "with the system C compiler), 'torch' uses the reference kernels only, 'auto' picks "
        "'cpu' on a CPU device when they build.",
        ["auto", *backend_names()],
    )

    def validate(self) -> None:
        if self.page_size < 1:
            raise ValueError("--page-size must be >= 1")
        if self.chunked_prefill_size < -1:
            raise ValueError("--chunked-prefill-size must be -1 (off), 0 (by device) or >= 1")
        if self.max_prefill_tokens < 0:
            raise ValueError("--max-prefill-tokens must be >= 0 (0: by device)")
        if self.mamba_track_interval < 1:
            raise ValueError("--mamba-track-interval must be >= 1")
        if not 0 < self.mem_fraction_static <= 1:
            raise ValueError("--mem-fraction-static must be in (0, 1]")
        if self.mem_budget_gb < 0:
            raise ValueError("--mem-budget-gb must be >= 0 (0: use --mem-fraction-static)")
        if not 0 < self.mamba_full_memory_ratio:
            raise ValueError("--mamba-full-memory-ratio must be > 0")
        if self.decode_graph_max_bs < 0:
            raise ValueError("--decode-graph-max-bs must be >= 0")
        if self.cuda_graph_max_bs < 0 or any(b < 1 for b in self.cuda_graph_bs):
            raise ValueError("--cuda-graph-max-bs must be >= 0 and --cuda-graph-bs sizes >= 1")
        self._validate_speculative()
        on_cuda = self.device.split(":", 1)[0] == "cuda"
        if not on_cuda and (self.cuda_graph_bs or self.cuda_graph_max_bs != 256):
            raise ValueError(
                "--cuda-graph-bs and --cuda-graph-max-bs are for --device cuda; a CPU device "
                "replays its decode steps up to --decode-graph-max-bs"
            )
        if not self.watchdog_timeout > 0:
            raise ValueError("--watchdog-timeout must be > 0")
        if self.hicache_size < 0:
            raise ValueError("--hicache-size must be >= 0 GB (0: unbounded)")
        if not self.enable_hierarchical_cache:
            for flag, value in (
                ("--hicache-storage-dir", self.hicache_storage_dir),
                ("--hicache-storage-url", self.hicache_storage_url),
                ("--hicache-size", self.hicache_size),
            ):
                if value:
                    raise ValueError(f"{flag} needs --enable-hierarchical-cache")
        elif self.hicache_storage_backend == "file" and self.hicache_storage_url:
            raise ValueError("--hicache-storage-url is for --hicache-storage-backend redis")
        elif self.hicache_storage_backend == "redis" and self.hicache_storage_dir:
            raise ValueError("--hicache-storage-dir is for --hicache-storage-backend file")
        elif self.disable_radix_cache:
            raise ValueError(
                "--enable-hierarchical-cache stores the radix cache's prefixes: it cannot be "
                "combined with --disable-radix-cache"
            )
        check_device(self.device)

    def with_device_defaults(self) -> EngineConfig:
        """A copy with the fields left at 0 for the device to decide given their values
        (``prefill_defaults``); called once ``validate`` has checked the device."""
        if self.chunked_prefill_size and self.max_prefill_tokens:
            return self
        memory = None
        if self.device.split(":", 1)[0] == "cuda":
            import torch

            memory = torch.cuda.get_device_properties(torch.device(self.device)).total_memory
        chunk, budget = prefill_defaults(self.device, memory)
        chunk = self.chunked_prefill_size or chunk
        return dataclasses.replace(
            self,
            chunked_prefill_size=chunk,
            max_prefill_tokens=self.max_prefill_tokens or max(budget, chunk),
        )

    def _validate_speculative(self) -> None:
        algo = self.speculative_algorithm
        if not algo:
            for f in dataclasses.fields(self):
                if f.name.startswith("speculative_") and getattr(self, f.name) != f.default:
                    raise ValueError(f"{_flag(f.name)} needs --speculative-algorithm")
            return
        k = self.speculative_num_steps
        if k < 1:
            raise ValueError("--speculative-num-steps must be >= 1")
        if self.speculative_eagle_topk != 1:
            raise ValueError(
                "--speculative-eagle-topk: only 1 (one chain of drafts) is supported, got "
                f"{self.speculative_eagle_topk}"
            )
        if self.speculative_num_draft_tokens not in (0, k + 1):
            raise ValueError(
                f"--speculative-num-draft-tokens must be --speculative-num-steps + 1 ({k + 1}) "
                "with --speculative-eagle-topk 1"
            )
        if self.speculative_disable_by_batch_size < 0:
            raise ValueError("--speculative-disable-by-batch-size must be >= 0 (0: never)")
        if self.speculative_adaptive_costs and not self.speculative_adaptive:
            raise ValueError("--speculative-adaptive-costs needs --speculative-adaptive")
        if self.speculative_token_map and algo not in ("NEXTN", "MTP"):
            raise ValueError("--speculative-token-map is for --speculative-algorithm NEXTN / MTP")
        lo = self.speculative_ngram_min_match_window_size
        hi = self.speculative_ngram_max_match_window_size
        if not 1 <= lo <= hi:
            raise ValueError(
                "--speculative-ngram-min-match-window-size must be >= 1 and <= "
                "--speculative-ngram-max-match-window-size"
            )


def prefill_defaults(device: str, memory_bytes: int | None) -> tuple[int, int]:
    """``(chunked_prefill_size, max_prefill_tokens)`` for a device whose flags are left at 0.
    On a CPU 512 and 4096: a 512-token forward already runs its matmuls at the machine's rate,
    and keeps the steps of a running decode batch short between a long prompt's chunks. On a
    CUDA device SGLang's, by the device's memory (``memory_bytes``): a chunk of 2048 tokens under
    35 GiB, 8192 under 160 GiB (H100, H200), else 16384; 16384 tokens a forward. Larger chunks
    there keep the matmuls of one long prompt large and its forwards (each with its launches and
    its metadata) few."""
    if device.split(":", 1)[0] != "cuda":
        return 512, 4096
    gib = (memory_bytes or 0) / 2**30
    chunk = 2048 if gib < 35 else 8192 if gib < 160 else 16384
    return chunk, 16384


def check_device(device: str) -> None:
    """Raise ValueError if torch cannot use ``device`` here (CUDA asked on a CPU build)."""
    import torch

    kind = device.split(":", 1)[0]
    if kind == "cpu":
        return
    if kind == "cuda":
        if torch.version.cuda is None:
            raise ValueError(
                f"--device {device}: this torch build ({torch.__version__}) has no CUDA "
                "support; use --device cpu or install a CUDA build of torch"
            )
        if not torch.cuda.is_available():
            raise ValueError(f"--device {device}: no CUDA device is visible")
        return
    try:
        torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"--device {device}: {e}") from None


@dataclass
class ServerConfig:
    host: str = opt("127.0.0.1", "Address to bind.")
    port: int = opt(30000, "Port to bind.")
    api_key: str = opt("", "If set, requests must send 'Authorization: Bearer <key>'.")
    served_model_name: str = opt(
        "", "Model name reported by /v1/models; defaults to the model path."
    )
    log_level: str = opt("info", "Log level.", ["debug", "info", "warning", "error"])
    chat_template: str = opt(
        "", "Chat template replacing the checkpoint's: a Jinja file's path or the template itself."
    )
    reasoning_parser: str = opt(
        "",
        "Split <think>...</think> out of chat replies into reasoning_content: 'qwen3' (a reply "
        "may open a think block; one the prompt opened is continued), 'deepseek-r1' / "
        "'qwen3-thinking' (replies start in reasoning unless enable_thinking is false). A chat "
        "request's structured output (response_format, a forced tool call) then binds the "
        "answer after </think>, not the reasoning.",
        ["qwen3", "deepseek-r1", "qwen3-thinking"],
    )
    tool_call_parser: str = opt(
        "",
        "Tool-call format of the model's replies (SGLang's names): 'qwen' / 'qwen25' / 'hermes' "
        "(<tool_call> JSON), 'qwen3_coder' (<tool_call><function=...> XML), 'granite4', "
        "'lfm2' / 'pythonic', 'nemotron' (<TOOLCALL>); default: detected from the chat "
        "template's markers.",
        ["qwen", "qwen25", "hermes", "qwen3_coder", "granite4", "granite", "lfm2", "pythonic",
         "nemotron"],
    )  # fmt: skip
    max_body_mb: float = opt(64.0, "Largest request body accepted (MiB); larger ones get 413.")
    graceful_shutdown_timeout: float = opt(
        30.0,
        "On SIGTERM: stop admitting, let running requests finish for this many seconds, then "
        "abort the rest (each stream gets a final 'abort' event) and exit 0.",
    )
    metrics_prefix: str = opt(
        "mambaradix",
        "Prefix of the /metrics names ('sglang' lets SGLang's dashboards work unchanged).",
    )
    enable_debug_endpoints: bool = opt(
        False,
        "Serve the debug routes (GET /debug/tree: the radix tree as Mermaid or DOT text), "
        "behind --api-key like the others; off: they answer 404.",
    )

    def validate(self) -> None:
        import re

        if not re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", self.metrics_prefix):
            raise ValueError(
                f"--metrics-prefix {self.metrics_prefix!r}: letters, digits and '_' only"
            )
        if self.graceful_shutdown_timeout < 0:
            raise ValueError("--graceful-shutdown-timeout must be >= 0")
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port {self.port} is not a port number")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _base_type(tp: Any) -> Any:
    """The type a flag parses (a ``tuple[int, ...]`` field stays a tuple: a list flag)."""
    if isinstance(tp, str):
        tp = {"int": int, "float": float, "str": str, "bool": bool}.get(
            tp.split("|")[0].strip(), str
        )
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0]
    return tp


def add_config_args(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add one flag per dataclass field of ``cls``."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = _base_type(hints.get(f.name, f.type))
        help_text = f.metadata.get("help", "")
        if tp is bool:
            parser.add_argument(
                _flag(f.name), dest=f.name, action="store_true", default=f.default, help=help_text
            )
            continue
        if typing.get_origin(tp) is tuple:  # a list of values: --flag 1 2 4
            parser.add_argument(
                _flag(f.name), dest=f.name, type=typing.get_args(tp)[0], nargs="+",
                default=f.default, help=f"{help_text} (default: {f.default or 'none'})",
            )  # fmt: skip
            continue
        kwargs: dict[str, Any] = {
            "dest": f.name,
            "type": tp,
            "default": f.default,
            "help": f"{help_text} (default: {f.default})",
        }
        if "choices" in f.metadata:
            kwargs["choices"] = f.metadata["choices"]
        parser.add_argument(_flag(f.name), **kwargs)


def config_from_args(cls: type[T], ns: argparse.Namespace) -> T:
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    return cls(
        **{k: tuple(v) if isinstance(v, list) else v for k, v in vars(ns).items() if k in names}
    )
