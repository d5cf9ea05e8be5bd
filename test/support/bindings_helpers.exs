defmodule VllmBridge.BindingsHelpers do
  @moduledoc false
  # Helpers for the tests of the generated bindings (test/bindings): a pool that the
  # bindings reach without `__runtime__` options, the exported arities of a module, and
  # the bindings task run in a project folder.

  @pool :bindings

  @doc """
  Starts the pool `:bindings` for a test module and makes it the default pool of calls
  without a `pool_name` (the application's runtime config); both undone on exit.
  """
  def start_default_pool!(opts \\ []) do
    {:ok, _} = VllmBridge.start_pool(@pool, Keyword.merge([size: 1], opts))
    :ok = VllmBridge.Pool.await_ready(@pool, 60_000)
    old = Application.fetch_env(:vllm_bridge, :runtime)
    Application.put_env(:vllm_bridge, :runtime, pool_name: @pool)

    ExUnit.Callbacks.on_exit(fn ->
      case old do
        {:ok, value} -> Application.put_env(:vllm_bridge, :runtime, value)
        :error -> Application.delete_env(:vllm_bridge, :runtime)
      end

      VllmBridge.stop_pool(@pool)
    end)

    @pool
  end

  @doc "Opens a session on the bindings pool, closed when the test ends."
  def session!(opts \\ []) do
    {:ok, s} = VllmBridge.Session.open(Keyword.put_new(opts, :pool_name, @pool))
    ExUnit.Callbacks.on_exit(fn -> VllmBridge.Session.close(s) end)
    s
  end

  @doc "`name => arities` of a module's public functions (the struct/registry ones left out)."
  def exported(module) do
    module.__info__(:functions)
    |> Enum.reject(fn {name, _} ->
      name in [:__struct__, :__python_class__, :__python_fields__, :__members__]
    end)
    |> Enum.group_by(&elem(&1, 0), &elem(&1, 1))
    |> Map.new(fn {name, arities} -> {name, Enum.min(arities)..Enum.max(arities)} end)
  end

  @doc "Whether every arity of the range is exported (no gaps)."
  def contiguous?(module, name, range),
    do: Enum.all?(range, &function_exported?(module, name, &1))

  @doc "A TCP port that was free a moment ago."
  def free_port do
    {:ok, socket} = :gen_tcp.listen(0, [])
    {:ok, port} = :inet.port(socket)
    :gen_tcp.close(socket)
    port
  end

  @doc "Runs `mix vllm.gen.bindings argv` in `dir` (its project root); the shell's info lines."
  def gen_task!(dir, argv) do
    Mix.shell(Mix.Shell.Process)

    try do
      File.cd!(dir, fn -> Mix.Task.rerun("vllm.gen.bindings", argv) end)
      collect_info([])
    after
      Mix.shell(Mix.Shell.IO)
    end
  end

  @doc "The message of the `Mix.Error` that `gen_task!(dir, argv)` raises (fails if none)."
  def gen_task_error(dir, argv) do
    e = ExUnit.Assertions.assert_raise(Mix.Error, fn -> gen_task!(dir, argv) end)
    Exception.message(e)
  end

  defp collect_info(acc) do
    receive do
      {:mix_shell, :info, [line]} -> collect_info([line | acc])
    after
      0 -> Enum.reverse(acc)
    end
  end
end
