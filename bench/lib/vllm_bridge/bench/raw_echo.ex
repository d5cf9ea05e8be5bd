defmodule VllmBridge.Bench.RawEcho do
  @moduledoc """
  The floor of the bridge benchmarks: an Erlang port to `bench/raw_echo.py`, a Python
  process that only reads `{packet, 4}` frames on fd 3 and writes them back on fd 4 (no
  codec, no dispatch).

  * `roundtrip/2` - the caller owns the port: send a frame, wait for it (latency floor);
  * `start_owner/1` + `call/2` - an owner process per port, as a worker has, taking
    requests from many callers, pipelining them to the port and replying in FIFO order
    (throughput floor at a given concurrency).
  """

  @doc "Opens a port to the echo process (`python` is the interpreter)."
  @spec open(String.t()) :: port()
  def open(python) do
    script = Path.expand("bench/raw_echo.py")

    unless File.regular?(script),
      do: raise("#{script} not found: run the benchmarks from the repository root")

    Port.open({:spawn_executable, python}, [
      {:args, [script]},
      {:packet, 4},
      :binary,
      :nouse_stdio,
      :exit_status
    ])
  end

  @doc "Closes a port opened by `open/1` (the echo process exits on EOF)."
  @spec close(port()) :: :ok
  def close(port) do
    Port.close(port)
    :ok
  catch
    :error, :badarg -> :ok
  end

  @doc "One frame to the echo and back, on a port the caller owns: `{:ok, frame}`."
  @spec roundtrip(port(), iodata()) :: {:ok, binary()}
  def roundtrip(port, frame) do
    Port.command(port, frame)

    receive do
      {^port, {:data, data}} -> {:ok, data}
      {^port, {:exit_status, status}} -> raise "raw echo exited with status #{status}"
    end
  end

  @doc "Starts an owner process with its own echo port (linked to the caller)."
  @spec start_owner(String.t()) :: pid()
  def start_owner(python) do
    spawn_link(fn -> owner_loop(open(python), :queue.new()) end)
  end

  @doc "Stops an owner (its port closes)."
  @spec stop_owner(pid()) :: :ok
  def stop_owner(pid) do
    ref = Process.monitor(pid)
    send(pid, :stop)

    receive do
      {:DOWN, ^ref, :process, _, _} -> :ok
    end
  end

  @doc "A round trip through an owner: `{:ok, frame}`."
  @spec call(pid(), iodata()) :: {:ok, binary()}
  def call(owner, frame) do
    ref = make_ref()
    send(owner, {:echo, self(), ref, frame})

    receive do
      {^ref, data} -> {:ok, data}
    end
  end

  defp owner_loop(port, waiting) do
    receive do
      {:echo, from, ref, frame} ->
        Port.command(port, frame)
        owner_loop(port, :queue.in({from, ref}, waiting))

      {^port, {:data, data}} ->
        {{:value, {from, ref}}, waiting} = :queue.out(waiting)
        send(from, {ref, data})
        owner_loop(port, waiting)

      :stop ->
        close(port)
    end
  end
end
