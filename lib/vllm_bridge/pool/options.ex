defmodule VllmBridge.Pool.Options do
  @moduledoc """
  A pool's options, checked once when it starts (see `VllmBridge.Pool.start/2`).

  | option | meaning | default |
  |---|---|---|
  | `:size` | worker processes | 1 |
  | `:python` | Python interpreter | `config :vllm_bridge, :python` |
  | `:allow` | module allow-list (`--allow`), `[]` for the worker's default | `[]` |
  | `:max_refs` | references a worker may hold (`--max-refs`) | the worker's (10 000) |
  | `:poll_us` | µs a worker polls for the next request before it sleeps (`--poll-us`, at most 10 000): lower latency for back-to-back calls on machines where waking an idle CPU is slow (VMs), paid in that much CPU after each call | 0 |
  | `:worker_env` | environment per worker: `[{name, value}]` for all, or `fn index -> [{name, value}] end` (a DP rank per worker) | `[]` |
  | `:max_in_flight` | calls pipelined to one worker at once | 16 |
  | `:max_frame_bytes` | the largest frame body either way (`--max-frame-bytes`): a request over it is `:bad_argument` before it is sent, a reply over it is an error from the worker, a header declaring more ends the stream (the worker restarts); 65 536 to 4 294 967 295 | 1 073 741 824 (1 GiB) |
  | `:queue_size` | callers that may wait for a worker; one more gets `:queue_full` | 1024 |
  | `:start_timeout` | ms for a worker's handshake | 60 000 |
  | `:cancel_grace` | ms a cancelled call (timed out, or its caller died) may keep running before its worker's Python process is killed and restarted; a cancel interrupts the call in Python, so only one that does not stop (stuck in C code, in an `__enter__`, or catching the interruption) reaches it (see `VllmBridge`) | 5 000 |
  | `:shutdown_grace` | ms a worker's Python process has to exit on EOF before it is killed | 3 000 |
  | `:max_restarts`, `:max_seconds` | restart intensity of the pool's supervisor | `10 + 3 * size`, 30 |
  | `:worker_module` | the Python module run with `-m`; it is always passed `--max-frame-bytes N` (and `--allow`, `--max-refs`, `--poll-us` when those are set), so a module of one's own must accept them | `"vllm_bridge.bridge.worker"` |
  """

  alias VllmBridge.Error

  @defaults [
    size: 1,
    allow: [],
    max_refs: nil,
    poll_us: 0,
    worker_env: [],
    max_in_flight: 16,
    max_frame_bytes: VllmBridge.Worker.Launcher.default_max_frame_bytes(),
    queue_size: 1024,
    start_timeout: 60_000,
    cancel_grace: 5_000,
    shutdown_grace: 3_000,
    max_restarts: nil,
    max_seconds: 30,
    worker_module: "vllm_bridge.bridge.worker"
  ]

  @keys [:python | Keyword.keys(@defaults)]

  @doc "The option names a pool accepts."
  @spec keys() :: [atom()]
  def keys, do: @keys

  @doc "Checks `opts` and fills in the defaults; `:bad_argument` naming a bad one."
  @spec validate(keyword()) :: {:ok, keyword()} | {:error, Error.t()}
  def validate(opts) when is_list(opts) do
    with :ok <- known(opts) do
      python =
        Keyword.get_lazy(opts, :python, fn -> Application.get_env(:vllm_bridge, :python) end)

      opts = Keyword.merge(@defaults, Keyword.put(opts, :python, python))

      with :ok <- each(opts),
           {:ok, envs} <- envs(opts) do
        size = opts[:size]

        {:ok,
         opts
         |> Keyword.update!(:max_restarts, &(&1 || 10 + 3 * size))
         |> Keyword.put(:envs, envs)}
      end
    end
  end

  def validate(other), do: bad("pool options must be a keyword list, got #{inspect(other)}")

  # The environment of each worker as `[{name, value}]` strings (`:envs`, by index).
  defp envs(opts) do
    envs =
      for i <- 0..(opts[:size] - 1) do
        case opts[:worker_env] do
          f when is_function(f, 1) -> f.(i)
          list -> list
        end
        |> Enum.map(fn {k, v} -> {to_string(k), to_string(v)} end)
      end

    {:ok, envs}
  rescue
    e ->
      bad(
        "pool option worker_env: building a worker's environment failed: " <> Exception.message(e)
      )
  end

  defp known(opts) do
    case Enum.find(opts, fn
           {k, _} -> k not in @keys
           _ -> true
         end) do
      nil -> :ok
      {k, _} -> bad("unknown pool option #{inspect(k)}; known: #{inspect(@keys)}")
      other -> bad("pool options must be a keyword list, got the element #{inspect(other)}")
    end
  end

  defp each(opts) do
    Enum.reduce_while(opts, :ok, fn {k, v}, :ok ->
      case check(k, v) do
        :ok -> {:cont, :ok}
        {:error, why} -> {:halt, bad("pool option #{k}: #{why}, got #{inspect(v, limit: 8)}")}
      end
    end)
  end

  defp check(:size, v) when is_integer(v) and v >= 1, do: :ok
  defp check(:size, _), do: {:error, "must be a positive integer"}
  defp check(:python, v) when is_binary(v), do: :ok
  defp check(:python, _), do: {:error, "must be the path of a Python interpreter"}

  defp check(:allow, v) when is_list(v),
    do: if(Enum.all?(v, &is_binary/1), do: :ok, else: {:error, "must be a list of module names"})

  defp check(:allow, _), do: {:error, "must be a list of module names"}
  defp check(:max_refs, nil), do: :ok
  defp check(:max_refs, v) when is_integer(v) and v >= 1, do: :ok
  defp check(:max_refs, _), do: {:error, "must be a positive integer"}
  defp check(:poll_us, v) when is_integer(v) and v >= 0 and v <= 10_000, do: :ok
  defp check(:poll_us, _), do: {:error, "must be an integer from 0 to 10000 (microseconds)"}
  defp check(:worker_env, f) when is_function(f, 1), do: :ok

  defp check(:worker_env, v) when is_list(v) do
    if Enum.all?(v, &match?({k, _} when is_binary(k) or is_atom(k), &1)),
      do: :ok,
      else: {:error, "must be [{name, value}] or fn index -> [{name, value}] end"}
  end

  defp check(:worker_env, _),
    do: {:error, "must be [{name, value}] or fn index -> [{name, value}] end"}

  defp check(k, v) when k in [:max_in_flight, :max_seconds] and is_integer(v) and v >= 1, do: :ok

  defp check(k, _) when k in [:max_in_flight, :max_seconds],
    do: {:error, "must be a positive integer"}

  defp check(k, v)
       when k in [:queue_size, :start_timeout, :cancel_grace, :shutdown_grace, :max_restarts] and
              is_integer(v) and v >= 0,
       do: :ok

  defp check(:max_restarts, nil), do: :ok

  defp check(k, _)
       when k in [:queue_size, :start_timeout, :cancel_grace, :shutdown_grace, :max_restarts],
       do: {:error, "must be a non-negative integer"}

  defp check(:max_frame_bytes, v) when is_integer(v) do
    range = VllmBridge.Worker.Launcher.max_frame_range()
    if v in range, do: :ok, else: {:error, "must be from #{range.first} to #{range.last}"}
  end

  defp check(:max_frame_bytes, _), do: {:error, "must be an integer (bytes)"}

  defp check(:worker_module, v) when is_binary(v), do: :ok
  defp check(:worker_module, _), do: {:error, "must be a module name"}

  defp bad(message), do: {:error, Error.new(:bad_argument, message)}
end
