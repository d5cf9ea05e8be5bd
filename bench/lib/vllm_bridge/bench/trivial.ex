defmodule VllmBridge.Bench.Trivial do
  @moduledoc """
  The trivial call the round-trip benchmarks time through the whole stack: the generated
  binding `Vllm.ForwardContext.Module.is_forward_context_available/1` of
  `vllm_bridge.forward_context.is_forward_context_available()` (no arguments, a boolean
  back), so the figures include the binding's argument handling.
  """

  alias VllmBridge.Call.{Request, Wire}

  @target {"vllm_bridge.forward_context", "is_forward_context_available"}

  @doc "Makes the trivial call with runtime options `opts`; `{:ok, boolean}` expected."
  @spec call(keyword()) :: {:ok, boolean()} | {:error, VllmBridge.Error.t()}
  def call(opts), do: Vllm.ForwardContext.Module.is_forward_context_available(__runtime__: opts)

  @doc """
  The body of the frame the trivial call sends (session nil, a timeout), without its
  4-byte length: what the raw echo, whose port adds the length itself (`{:packet, 4}`),
  sends to be compared with it.
  """
  @spec request_frame() :: binary()
  def request_frame do
    {:ok, parts} = Wire.encode_invoke(@target, [], %{})
    req = Request.new("call", pre: [Wire.value(nil)], post: parts)

    <<_length::32, body::binary>> =
      IO.iodata_to_binary(
        Wire.request(req.kind, 1_000_000, req.pre ++ [Wire.value(120_000) | req.post])
      )

    body
  end
end
