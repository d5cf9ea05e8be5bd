defmodule VllmBridge.Bench.Tensors do
  @moduledoc """
  Tensor round trips: a float32 tensor of 1, 16 and 64 MiB to a worker and back
  (`vllm_bridge.bridge.diag.echo`, decoded on both sides), beside the raw echo of a frame of the
  same size. The figure is the tensor's bytes divided by the median round-trip time
  (each byte goes out and comes back; counting both directions would double it).
  """

  alias VllmBridge.Bench.{RawEcho, Stats}
  alias VllmBridge.Tensor
  alias VllmBridge.Call.Wire

  @doc """
  Measures each size: a list of `%{mib: n, full_ms: median, raw_ms: median, reps: r}`.
  Options: `:sizes_mib` (default `[1, 16, 64]`), `:reps` (`fn mib -> count end`).
  """
  @spec run(term(), String.t(), keyword()) :: [map()]
  def run(pool, python, opts) do
    sizes = Keyword.get(opts, :sizes_mib, [1, 16, 64])

    reps =
      Keyword.get(opts, :reps, fn mib ->
        if mib >= 64, do: 5, else: if(mib >= 16, do: 8, else: 20)
      end)

    port = RawEcho.open(python)

    try do
      Enum.map(sizes, fn mib -> measure(pool, port, mib, reps.(mib)) end)
    after
      RawEcho.close(port)
    end
  end

  defp measure(pool, port, mib, reps) do
    bytes = mib * 1024 * 1024
    tensor = Tensor.new(:binary.copy(<<0, 0, 128, 63>>, div(bytes, 4)), :float32, [div(bytes, 4)])
    {:ok, parts} = Wire.encode_invoke({"vllm_bridge.bridge.diag", "echo"}, [tensor], %{})
    raw_frame = :binary.copy(<<0>>, IO.iodata_length(parts) + 16)

    full = fn ->
      case VllmBridge.call({"vllm_bridge.bridge.diag", "echo"}, [tensor], %{},
             pool_name: pool,
             timeout: 300_000
           ) do
        {:ok, %Tensor{data: data}} when byte_size(data) == bytes -> :ok
        other -> other
      end
    end

    raw = fn -> RawEcho.roundtrip(port, raw_frame) end
    Stats.time_calls(1, full)
    Stats.time_calls(1, raw)

    {f, r} =
      Enum.reduce(1..reps, {[], []}, fn _, {f, r} ->
        {Stats.time_calls(1, full) ++ f, Stats.time_calls(1, raw) ++ r}
      end)

    %{
      mib: mib,
      bytes: bytes,
      reps: reps,
      full_ms: Stats.median(f) / 1000,
      raw_ms: Stats.median(r) / 1000
    }
  end
end
