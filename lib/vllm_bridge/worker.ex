defmodule VllmBridge.Worker do
  @moduledoc """
  One Elixir process per Python worker OS process: it owns the Port (`{packet, 4}` on
  fds 3/4, `:nouse_stdio`), checks the worker's handshake, and routes each reply straight
  to the caller waiting for it.
  """
  use GenServer

  alias VllmBridge.Codec.Msgpack
  alias VllmBridge.Error

  @protocol_version 1
  @start_timeout 60_000

  @typedoc "What the worker announced in its handshake."
  @type hello :: %{optional(String.t()) => term()}

  @doc """
  Starts a worker linked to the caller. Options: `:python` (interpreter path; default from
  the `:vllm_bridge, :python` application env), `:env` (extra environment as
  `[{name, value}]`), `:start_timeout` (ms, default #{@start_timeout}).
  """
  @spec start_link(keyword()) :: GenServer.on_start()
  def start_link(opts \\ []) do
    GenServer.start_link(__MODULE__, opts, Keyword.take(opts, [:name]))
  end

  @doc "The handshake the Python process announced."
  @spec hello(GenServer.server()) :: hello()
  def hello(worker), do: GenServer.call(worker, :hello)

  @doc "The OS pid of the Python process."
  @spec os_pid(GenServer.server()) :: non_neg_integer()
  def os_pid(worker), do: Map.fetch!(hello(worker), "pid")

  @doc """
  Calls `module.name(*args, **kwargs)` in the Python worker and waits up to `timeout` ms.
  """
  @spec call(GenServer.server(), String.t(), String.t(), list(), map(), timeout()) ::
          {:ok, term()} | {:error, Error.t()}
  def call(worker, module, name, args \\ [], kwargs \\ %{}, timeout \\ 5_000) do
    GenServer.call(worker, {:call, module, name, args, kwargs, timeout}, :infinity)
  end

  @doc "Closes the port; the Python process sees EOF on fd 3 and exits by itself."
  @spec close(GenServer.server()) :: :ok
  def close(worker), do: GenServer.call(worker, :close)

  @impl true
  def init(opts) do
    python =
      Keyword.get_lazy(opts, :python, fn -> Application.fetch_env!(:vllm_bridge, :python) end)

    env = for {k, v} <- Keyword.get(opts, :env, []), do: {to_charlist(k), to_charlist(v)}

    unless File.exists?(python) do
      {:stop, {:python_not_found, python}}
    else
      port =
        Port.open({:spawn_executable, python}, [
          {:args, ["-m", "vllm_bridge.worker"]},
          {:packet, 4},
          {:env, env},
          :binary,
          :nouse_stdio,
          :exit_status
        ])

      timeout = Keyword.get(opts, :start_timeout, @start_timeout)

      receive do
        {^port, {:data, data}} ->
          case Msgpack.decode(data) do
            {:ok, ["hello", %{"protocol" => @protocol_version} = hello]} ->
              {:ok, %{port: port, hello: hello, next_id: 1, calls: %{}}}

            {:ok, ["hello", %{"protocol" => other}]} ->
              Port.close(port)
              {:stop, {:protocol_mismatch, expected: @protocol_version, got: other}}

            other ->
              Port.close(port)
              {:stop, {:bad_handshake, other}}
          end

        {^port, {:exit_status, status}} ->
          {:stop, {:worker_exit_during_start, status}}
      after
        timeout ->
          Port.close(port)
          {:stop, {:start_timeout, timeout}}
      end
    end
  end

  @impl true
  def handle_call(:hello, _from, state), do: {:reply, state.hello, state}

  def handle_call(:close, _from, state) do
    Port.close(state.port)
    {:stop, :normal, :ok, state}
  end

  def handle_call({:call, module, name, args, kwargs, timeout}, from, state) do
    id = state.next_id
    frame = Msgpack.encode(["call", id, nil, timeout, ["m", module, name], args, kwargs])
    Port.command(state.port, frame)
    {:noreply, %{state | next_id: id + 1, calls: Map.put(state.calls, id, from)}}
  end

  @impl true
  def handle_info({port, {:data, data}}, %{port: port} = state) do
    case Msgpack.decode(data) do
      {:ok, [kind, id, payload]} when kind in ["ok", "error"] ->
        {from, calls} = Map.pop(state.calls, id)
        if from, do: GenServer.reply(from, reply(kind, payload))
        {:noreply, %{state | calls: calls}}

      _ ->
        {:noreply, state}
    end
  end

  def handle_info({port, {:exit_status, status}}, %{port: port} = state) do
    for {_id, from} <- state.calls do
      GenServer.reply(
        from,
        {:error, Error.new(:worker_exit, "worker exited with status #{status}")}
      )
    end

    {:stop, {:worker_exit, status}, %{state | calls: %{}}}
  end

  defp reply("ok", value), do: {:ok, value}

  defp reply("error", %{"type" => "python_exception"} = e),
    do:
      {:error,
       Error.new(:python_exception, e["message"] || "",
         python_type: e["python_type"],
         traceback: e["traceback"]
       )}

  defp reply("error", e), do: {:error, Error.new(:protocol, inspect(e))}
end
