"""Which CUDA graph a batch runs with: :class:`CudagraphDispatcher`, decided as vLLM's is.

The decisions follow vLLM's ``CudagraphDispatcher`` (``vllm/v1/cudagraph_dispatcher.py``,
https://github.com/vllm-project/vllm/blob/main/vllm/v1/cudagraph_dispatcher.py); the code is
our own. The rule, in short:

* The graphs that exist are two sets of :class:`BatchDescriptor` keys, one per runtime mode
  (PIECEWISE, FULL), built once from the configured mode, the capture sizes,
  ``max_num_seqs``, the uniform-decode query length and the LoRA capture counts. Only keys
  in these sets are ever captured, so only they may be dispatched to.
* Mixed-batch keys: every capture size, relaxed (``num_reqs=None, uniform=False``), under
  the configured mode's mixed routine (if it is not NONE).
* Uniform-decode keys (FULL, two-routine modes only): capture sizes ``s`` with
  ``q <= s <= q * max_num_seqs`` (``q``: the uniform-decode query length), keyed with
  ``num_reqs = s // q`` and ``uniform=True``. A decode batch of more than ``max_num_seqs``
  requests cannot happen, so vLLM captures no decode graph for it; a batch padded to such a
  size falls back to the mixed routine (issue 16's two examples).
* A batch is padded to the smallest capture size that holds it, described, and looked up:
  first its exact descriptor among the FULL keys, then its relaxed one among the FULL keys
  (both skipped with ``disable_full``, e.g. for cascade attention), then the relaxed one
  among the PIECEWISE keys; else it runs eagerly (NONE) at its own size.

:func:`dispatch_cudagraph` is the older ``(mode, padded)`` entry point, now a thin use of
the class.
"""

import bisect
import itertools

from vllm_bridge._checks import check_bool, check_instance, check_int
from vllm_bridge.config import CompilationConfig, VllmConfig
from vllm_bridge.cudagraph import CUDAGraphMode
from vllm_bridge.forward_context import BatchDescriptor

__all__ = ["CudagraphDispatcher", "captured_lora_counts", "dispatch_cudagraph"]

# The runtime modes that have graphs (and so key sets); NONE never has keys.
_GRAPH_MODES = (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL)


def captured_lora_counts(max_loras: int, specialize: bool) -> list[int]:
    """The active-adapter counts LoRA graphs are captured for (vLLM's ``lora/utils.py``).

    Specializing: the powers of two up to ``max_loras + 1``, and ``max_loras + 1`` itself
    (a batch's count is rounded up to the next of these). Not specializing: only
    ``max_loras + 1``, one graph sized for every batch with LoRA.
    """
    check_int("max_loras", max_loras, minimum=1)
    check_bool("specialize", specialize)
    top = max_loras + 1
    if not specialize:
        return [top]
    return [n for n in range(1, top + 1) if n & (n - 1) == 0 or n == top]


class CudagraphDispatcher:
    """Decides each batch's runtime mode and graph key from fixed sets of captured keys.

    Built once per model runner; :meth:`dispatch` is called every step and
    :meth:`capture_descriptors` lists what to capture. vLLM builds the keys in a second
    step (``initialize_cudagraph_keys``) because its mode is resolved after the attention
    backend is chosen; here the caller passes the resolved mode (``cudagraph_mode``) to
    the constructor instead, so a dispatcher is never half-built.

    Args:
        vllm_config: Capture sizes and mode (``compilation_config``), ``max_num_seqs``
            (``scheduler_config``) and the LoRA settings (``lora_config``).
        uniform_decode_query_len: Tokens per request of a uniform-decode batch: 1, or
            ``1 + num_speculative_tokens`` with speculative decoding.
        cudagraph_mode: The mode to build keys for, when it differs from the configured
            one (vLLM downgrades it when the attention backend cannot run FULL graphs);
            defaults to ``compilation_config.cudagraph_mode``.

    Raises:
        TypeError / ValueError: a bad argument, naming it; or, in a mode with FULL
            graphs, a capture size of at least ``uniform_decode_query_len`` that is not a
            multiple of it (a uniform batch padded to it would have a fractional
            ``num_reqs``; vLLM asserts on that at dispatch).
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        uniform_decode_query_len: int = 1,
        cudagraph_mode: CUDAGraphMode | None = None,
    ) -> None:
        check_instance("vllm_config", vllm_config, VllmConfig)
        check_int("uniform_decode_query_len", uniform_decode_query_len, minimum=1)
        check_instance("cudagraph_mode", cudagraph_mode, CUDAGraphMode, optional=True)
        compilation = vllm_config.compilation_config
        self.vllm_config = vllm_config
        self.cudagraph_mode = compilation.cudagraph_mode if cudagraph_mode is None else cudagraph_mode
        self.uniform_decode_query_len = uniform_decode_query_len
        self.max_num_seqs = vllm_config.scheduler_config.max_num_seqs
        self.capture_sizes: list[int] = list(compilation.cudagraph_capture_sizes)
        lora = vllm_config.lora_config
        self._lora_cases = self._lora_capture_cases(compilation)
        self._lora_counts = [n for n in self._lora_cases if n > 0]
        self._specialize_lora_count = lora is not None and lora.specialize_active_lora
        self._keys: dict[CUDAGraphMode, set[BatchDescriptor]] = {m: set() for m in _GRAPH_MODES}
        if self.cudagraph_mode is not CUDAGraphMode.NONE:
            self._check_sizes_fit_query_len()
            self._build_keys()

    # -- keys --------------------------------------------------------------------------------

    def _lora_capture_cases(self, compilation: CompilationConfig) -> list[int]:
        """Active-adapter counts to capture: 0 is "no LoRA" (vLLM's ``_get_lora_cases``)."""
        lora = self.vllm_config.lora_config
        if lora is None:
            return [0]
        if compilation.cudagraph_specialize_lora:
            return [0, *captured_lora_counts(lora.max_loras, lora.specialize_active_lora)]
        return [lora.max_loras + 1]

    def _check_sizes_fit_query_len(self) -> None:
        if not self.cudagraph_mode.has_mode(CUDAGraphMode.FULL):
            return  # without FULL graphs num_reqs is never derived from the query length
        q = self.uniform_decode_query_len
        for size in self.capture_sizes:
            if size >= q and size % q != 0:
                raise ValueError(
                    f"cudagraph_capture_sizes entry {size} is not a multiple of "
                    f"uniform_decode_query_len {q}; a uniform-decode batch padded to it "
                    f"has no whole number of requests (mode {self.cudagraph_mode.name})"
                )

    def _build_keys(self) -> None:
        mode, q = self.cudagraph_mode, self.uniform_decode_query_len
        mixed = mode.mixed_mode()
        if mixed is not CUDAGraphMode.NONE:
            for size, loras in itertools.product(self.capture_sizes, self._lora_cases):
                desc = self._describe(size, False, loras > 0, loras)
                self.add_cudagraph_key(mixed, desc.relax_for_mixed_batch_cudagraphs())
        # Separate decode graphs only in two-routine modes: with plain FULL the mixed keys
        # above already serve decode batches. A decode batch has at most max_num_seqs
        # requests of q tokens, so larger sizes are never needed as decode graphs.
        if mode.decode_mode() is CUDAGraphMode.FULL and mode.separate_routine():
            decode_sizes = [s for s in self.capture_sizes if q <= s <= q * self.max_num_seqs]
            for size, loras in itertools.product(decode_sizes, self._lora_cases):
                self.add_cudagraph_key(CUDAGraphMode.FULL, self._describe(size, True, loras > 0, loras))

    def add_cudagraph_key(self, runtime_mode: CUDAGraphMode, descriptor: BatchDescriptor) -> None:
        """Register a graph key; only PIECEWISE and FULL have graphs.

        Raises:
            TypeError: a wrong kind of argument.
            ValueError: ``runtime_mode`` is NONE or a two-routine mode.
        """
        check_instance("runtime_mode", runtime_mode, CUDAGraphMode)
        check_instance("descriptor", descriptor, BatchDescriptor)
        if runtime_mode not in _GRAPH_MODES:
            raise ValueError(
                f"runtime_mode must be PIECEWISE or FULL for a graph key, got {runtime_mode.name}"
            )
        self._keys[runtime_mode].add(descriptor)

    @property
    def cudagraph_keys(self) -> dict[CUDAGraphMode, frozenset[BatchDescriptor]]:
        """The keys per runtime mode (PIECEWISE, FULL): the graphs that may be dispatched."""
        return {mode: frozenset(keys) for mode, keys in self._keys.items()}

    def capture_descriptors(self) -> list[tuple[CUDAGraphMode, list[BatchDescriptor]]]:
        """What to capture: ``(mode, descriptors)`` for PIECEWISE then FULL, modes without
        keys left out; descriptors largest first (vLLM captures large graphs first so the
        smaller ones reuse the shared memory pool), ties by adapter count."""
        listed = []
        for mode in _GRAPH_MODES:
            descs = sorted(self._keys[mode], key=lambda d: (-d.num_tokens, d.num_active_loras))
            if descs:
                listed.append((mode, descs))
        return listed

    # -- dispatch ----------------------------------------------------------------------------

    def _describe(
        self, padded: int, uniform_decode: bool, has_lora: bool, num_active_loras: int
    ) -> BatchDescriptor:
        """The descriptor of a batch already padded to ``padded`` tokens.

        Only a uniform decode in a mode with FULL graphs keeps ``uniform`` (and a request
        count derived from the query length): other batches can only use relaxed keys.
        """
        if uniform_decode and self.cudagraph_mode.has_mode(CUDAGraphMode.FULL):
            num_reqs = padded // self.uniform_decode_query_len
        else:
            uniform_decode, num_reqs = False, min(padded, self.max_num_seqs)
        return BatchDescriptor(padded, num_reqs, uniform_decode, has_lora, num_active_loras)

    def _padded_size(self, num_tokens: int) -> int | None:
        """The smallest capture size holding ``num_tokens``; None for 0 or past the last."""
        idx = bisect.bisect_left(self.capture_sizes, num_tokens)
        if num_tokens == 0 or idx == len(self.capture_sizes):
            return None
        return self.capture_sizes[idx]

    def _graph_lora_count(self, num_active_loras: int) -> int:
        """The adapter count of the graph a LoRA batch uses: rounded up to a captured count
        when specializing (unchanged past the largest: no graph), else ``max_loras + 1``."""
        if num_active_loras == 0:
            return 0
        if self._specialize_lora_count:
            idx = bisect.bisect_left(self._lora_counts, num_active_loras)
            return self._lora_counts[idx] if idx < len(self._lora_counts) else num_active_loras
        return self.vllm_config.lora_config.max_loras + 1  # type: ignore[union-attr]

    def _check_batch(
        self, num_tokens: int, uniform_decode: bool, has_lora: bool,
        disable_full: bool, num_active_loras: int,
    ) -> None:
        check_int("num_tokens", num_tokens, minimum=0)
        check_bool("uniform_decode", uniform_decode)
        check_bool("has_lora", has_lora)
        check_bool("disable_full", disable_full)
        check_int("num_active_loras", num_active_loras, minimum=0)
        q = self.uniform_decode_query_len
        if uniform_decode and num_tokens % q != 0:
            raise ValueError(
                f"num_tokens {num_tokens} of a uniform-decode batch is not a multiple of "
                f"uniform_decode_query_len {q}"
            )
        if has_lora != (num_active_loras > 0):
            raise ValueError(
                f"has_lora={has_lora} disagrees with num_active_loras={num_active_loras} "
                "(a batch has LoRA exactly when it has active adapters)"
            )
        lora = self.vllm_config.lora_config
        if has_lora and lora is None:
            raise ValueError("has_lora=True, but no lora_config is set (LoRA is off)")
        if lora is not None and num_active_loras > lora.max_loras:
            raise ValueError(
                f"num_active_loras {num_active_loras} exceeds max_loras {lora.max_loras}"
            )

    def dispatch(
        self,
        num_tokens: int,
        uniform_decode: bool = False,
        has_lora: bool = False,
        disable_full: bool = False,
        num_active_loras: int = 0,
    ) -> tuple[CUDAGraphMode, BatchDescriptor]:
        """The runtime mode and graph key of a batch (before DP coordination).

        Args:
            num_tokens: The batch's real tokens.
            uniform_decode: Every request computes ``uniform_decode_query_len`` tokens.
            has_lora: The batch has active LoRA adapters.
            disable_full: Never choose FULL (a feature FULL graphs cannot run, e.g. cascade
                attention); PIECEWISE or NONE only.
            num_active_loras: Distinct active adapters (0 without LoRA).

        Returns:
            ``(mode, descriptor)``: mode NONE, PIECEWISE or FULL; the descriptor is a key
            of that mode's set, or, for NONE, ``BatchDescriptor(num_tokens)``.

        Raises:
            TypeError / ValueError: a bad argument, naming it.
        """
        self._check_batch(num_tokens, uniform_decode, has_lora, disable_full, num_active_loras)
        padded = self._padded_size(num_tokens)
        if self.cudagraph_mode is CUDAGraphMode.NONE or padded is None:
            return CUDAGraphMode.NONE, BatchDescriptor(num_tokens)
        loras = self._graph_lora_count(num_active_loras)
        exact = self._describe(padded, uniform_decode, has_lora, loras)
        relaxed = exact.relax_for_mixed_batch_cudagraphs()
        if not disable_full:
            for desc in (exact, relaxed):
                if desc in self._keys[CUDAGraphMode.FULL]:
                    return CUDAGraphMode.FULL, desc
        if relaxed in self._keys[CUDAGraphMode.PIECEWISE]:
            return CUDAGraphMode.PIECEWISE, relaxed
        return CUDAGraphMode.NONE, BatchDescriptor(num_tokens)


def dispatch_cudagraph(
    config: VllmConfig | CompilationConfig, num_tokens: int, uniform_decode: bool
) -> tuple[CUDAGraphMode, int]:
    """``(runtime_mode, padded_num_tokens)`` of a batch without LoRA (before DP coordination).

    A thin use of :class:`CudagraphDispatcher` (query length 1). A bare
    :class:`CompilationConfig` is taken with the default scheduler (``max_num_seqs`` 128)
    and no LoRA; pass the whole :class:`VllmConfig` to use its ``max_num_seqs``.
    """
    if isinstance(config, CompilationConfig):
        config = VllmConfig(compilation_config=config)
    check_instance("config", config, (VllmConfig, CompilationConfig))
    mode, desc = CudagraphDispatcher(config).dispatch(num_tokens, uniform_decode)
    return mode, desc.num_tokens
