defmodule VllmBridge.Bench.Tensors do
  @moduledoc """
  Tensor round trips: a float32 tensor of 1, 16 and 64 MiB to a worker and back
  (`vllm_bridge.bridge.diag.echo`, decoded on both sides), in alternating rounds:

    * `full`: through the full stack as a user calls it (`VllmBridge.call/4`): tensors
      of at least the threshold through shared memory (`VllmBridge.Shm`, ext 8), smaller
      ones through the pipe;
    * `pipe`: the same call with shared memory off both ways (arguments in
      `VllmBridge.Shm.without/1`, a pool of one worker whose environment lacks the slot
      directory): what the full stack did before;
    * `raw`: the raw echo of a frame of the same size (the pipe's floor).

  The figure is the tensor's bytes divided by the median round-trip time (each byte goes
  out and comes back; counting both directions would double it).
  """

  alias VllmBridge.Bench.{RawEcho, Stats}
  alias VllmBridge.Tensor
  alias VllmBridge.Call.Wire

  @pipe_pool :vllm_bench_pipe

  @doc """
  Measures each size: a list of `%{mib: n, full_ms: median, pipe_ms: median, raw_ms:
  median, reps: r}`. Options: `:sizes_mib` (default `[1, 16, 64]`), `:reps` (`fn mib ->
  count end`).
  """
  @spec run(term(), String.t(), keyword()) :: [map()]
  def run(pool, python, opts) do
    sizes = Keyword.get(opts, :sizes_mib, [1, 16, 64])

    reps =
      Keyword.get(opts, :reps, fn mib ->
        if mib >= 64, do: 5, else: if(mib >= 16, do: 8, else: 20)
      end)

    port = RawEcho.open(python)
    wrapper = no_shm_python(python)
    {:ok, _} = VllmBridge.start_pool(@pipe_pool, size: 1, python: wrapper)

    try do
      Enum.map(sizes, fn mib -> measure(pool, port, mib, reps.(mib)) end)
    after
      VllmBridge.stop_pool(@pipe_pool)
      File.rm(wrapper)
      RawEcho.close(port)
    end
  end

  # The interpreter without the slot directory in its environment: its results take
  # the pipe (the Python side writes slots only when it has a directory).
  defp no_shm_python(python) do
    path = Path.join(System.tmp_dir!(), "vllm_bench_no_shm_#{System.unique_integer([:positive])}")
    File.write!(path, "#!/bin/sh\nunset VLLM_BRIDGE_SHM_DIR\nexec #{python} \"$@\"\n")
    File.chmod!(path, 0o700)
    path
  end

  defp measure(pool, port, mib, reps) do
    bytes = round(mib * 1024 * 1024)
    tensor = Tensor.new(:binary.copy(<<0, 0, 128, 63>>, div(bytes, 4)), :float32, [div(bytes, 4)])

    {:ok, parts} =
      VllmBridge.Shm.without(fn ->
        Wire.encode_invoke({"vllm_bridge.bridge.diag", "echo"}, [tensor], %{})
      end)

    raw_frame = :binary.copy(<<0>>, IO.iodata_length(parts) + 16)
    echo = fn p -> call(p, tensor, bytes) end
    full = fn -> echo.(pool) end
    pipe = fn -> VllmBridge.Shm.without(fn -> echo.(@pipe_pool) end) end
    raw = fn -> RawEcho.roundtrip(port, raw_frame) end
    Enum.each([full, pipe, raw], &Stats.time_calls(1, &1))

    {f, p, r} =
      Enum.reduce(1..reps, {[], [], []}, fn _, {f, p, r} ->
        {Stats.time_calls(1, full) ++ f, Stats.time_calls(1, pipe) ++ p,
         Stats.time_calls(1, raw) ++ r}
      end)

    %{
      mib: mib,
      bytes: bytes,
      reps: reps,
      full_ms: Stats.median(f) / 1000,
      pipe_ms: Stats.median(p) / 1000,
      raw_ms: Stats.median(r) / 1000
    }
  end

  defp call(pool, tensor, bytes) do
    case VllmBridge.call({"vllm_bridge.bridge.diag", "echo"}, [tensor], %{},
           pool_name: pool,
           timeout: 300_000
         ) do
      {:ok, %Tensor{data: data}} when byte_size(data) == bytes -> :ok
      other -> other
    end
  end
end
