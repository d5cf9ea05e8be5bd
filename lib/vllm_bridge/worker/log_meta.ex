defmodule VllmBridge.Worker.LogMeta do
  @moduledoc false
  # The Logger metadata of everything logged about one worker: its Python logging records
  # (VllmBridge.Worker.PythonLog), its output lines (VllmBridge.Worker.Output) and the
  # worker's own warnings and errors. One place, so that a handler filtering on
  # `vllm_pool` / `vllm_worker` sees all of them alike: `vllm_worker` is the index in a
  # pool, nil outside one (a standalone worker has no index).

  @doc false
  @spec new(term(), non_neg_integer() | nil, non_neg_integer() | nil) :: keyword()
  def new(pool, index, os_pid),
    do: [vllm_pool: pool, vllm_worker: if(pool != nil, do: index), os_pid: os_pid]

  @doc false
  # The metadata of the worker whose state (VllmBridge.Worker's) is `state`.
  @spec of(map()) :: keyword()
  def of(state), do: new(state.pool, state.index, state.os_pid)
end
