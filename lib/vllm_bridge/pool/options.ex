defmodule VllmBridge.Pool.Options do
  @moduledoc """
  A pool's options, checked once when it starts (see `VllmBridge.Pool.start/2`).

  | option | meaning | default |
  |---|---|---|
  | `:size` | worker processes | 1 |
  | `:python` | the Python interpreter (a path), or a wrapper that execs or forks it in the same pid namespace (the worker's hello must name the started process, a descendant of it or a process of its process group, docs/PROTOCOL.md; `docker run` and the like are refused); its environment must have the `vllm_bridge` package (docs/USING.md). When the worker is closed or its process ends (its pool stopped, the worker killed), the wrapper and the interpreter are gone too: what has not exited within `shutdown_grace` of its port closing is killed, also a child the wrapper forked and left behind, one that never said hello (its start timed out), and a process the interpreter started in its process group and that outlived it (one started in a session of its own, `start_new_session=True`, is left alone; docs/PROTOCOL.md) | `config :vllm_bridge, :python`, else the environment variable `VLLM_BRIDGE_PYTHON` read when the pool starts |
  | `:python_path` | folders put in front of the workers' `PYTHONPATH` (where one's own Python modules live): paths, or `{app, path}` for `Application.app_dir(app, path)` (a release's `priv/python`); each must be a folder | `[]` |
  | `:modules` | Python modules added to the allow-list (one's own): `allow ++ modules`, or the worker's default list ++ `modules` | `[]` |
  | `:allow` | module allow-list (`--allow`), replacing the worker's default (`vllm_bridge.PUBLIC_MODULES`); `[]` keeps the default | `[]` |
  | `:max_refs` | references a worker may hold (`--max-refs`) | the worker's (10 000) |
  | `:poll_us` | µs a worker polls for the next request before it sleeps (`--poll-us`, at most 10 000): lower latency for back-to-back calls on machines where waking an idle CPU is slow (VMs), paid in that much CPU after each call | 0 |
  | `:worker_env` | environment per worker: `[{name, value}]` for all, `fn index -> [{name, value}] end`, or `{module, function, args}` called as `apply(module, function, [index \| args])` (a DP rank per worker; the MFA form can live in `config/*.exs`, which a release cannot hold functions in). `VLLM_BRIDGE_STDERR_FILE` and `VLLM_BRIDGE_STDERR_FD` (start-up stderr), `VLLM_BRIDGE_SHM_DIR` and `VLLM_BRIDGE_SHM_MIN_BYTES` (the slot directory for large tensors) are the launcher's own and are refused | `[]` |
  | `:dp` | the DP rank each worker is, and where the ranks meet: a `VllmBridge.DP.Rendezvous` (or its fields as a keyword list or map: `master_addr`, `master_port`, `world_size`, `ranks` (one per worker), `backend`, `timeout_s`), checked here; worker `i` gets rank `Enum.at(ranks, i)` and the rendezvous in its `VLLM_DP_*` environment (which `worker_env` then may not set). Ranks of one group may sit in pools on other nodes and hosts | `nil` |
  | `:on_start` | a Python callable each worker runs once before it takes any call, and again after every restart (loading a model, say): `{"module", "function", args}` or `{"module", "function", args, kwargs}` (strings and plain data, so a release's config can hold it). The module must be on the allow-list (`modules:`), and the call goes through the same checks as any call; its result is dropped. Its deadline is `start_timeout`, counted from the worker's handshake. A worker whose `on_start` raises does not start: `start_pool` returns `{:error, %VllmBridge.Error{type: :python_exception}}` with the Python type, message and traceback, naming the pool, the worker and the callable | `nil` |
  | `:max_in_flight` | calls pipelined to one worker at once | 16 |
  | `:max_frame_bytes` | the largest frame body either way (`--max-frame-bytes`): a request over it is `:bad_argument` before it is sent, a reply over it is an error from the worker (a reply's tensors in shared-memory slots count toward it; a slot past it is `:protocol`, unread), a header declaring more ends the stream (the worker restarts); 65 536 to 4 294 967 295 | 1 073 741 824 (1 GiB) |
  | `:queue_size` | callers that may wait for a worker; one more gets `:queue_full` | 1024 |
  | `:start_timeout` | ms for a worker's handshake, and again for its `on_start` (counted from the handshake), so a start may take up to twice it; each worker enforces its own, and `start_pool` waits for them | 60 000 |
  | `:cancel_grace` | ms a cancelled call (timed out, or its caller died) may keep running before its worker's Python process is killed and restarted; a cancel interrupts the call in Python, so only one that does not stop (stuck in C code, in an `__enter__`, or catching the interruption) reaches it (see `VllmBridge`) | 5 000 |
  | `:shutdown_grace` | ms a worker's Python process, and the processes it started in its process group, have to exit once its port closes before they are killed (docs/USING.md) | 3 000 |
  | `:max_restarts`, `:max_seconds` | restart intensity of the pool's supervisor | `10 + 3 * size`, 30 |
  | `:log_level` | the Python root logger's level in each worker (`:debug`, `:info`, `:warning`, `:error`); records at or above it reach `Logger` (metadata `vllm_pool`, `vllm_worker`, `os_pid`, `python_logger`). Whatever the workers write to stdout or stderr reaches `Logger` too, line by line (see the README, "Status and logs") | `:warning` |
  | `:progress` | called at each stage of each worker's start while `start_pool` waits (`fn info -> ... end` or `{module, function, args}`, called as `apply(module, function, [info \| args])`); `info` is a map: `pool`, `index`, `stage` (`:launch`, `:waiting` every 2 s, `:handshake`, `:on_start`, `:ready`, `:failed`), `elapsed_ms`, `os_pid`, `device`. It runs in a process of its own that `start_pool` starts (the workers send it their stages, in order per worker): a slow or blocked callback delays no worker's start and no `start_timeout`. `start_pool` returns once the callback has handled every stage reported before then, or at the start's own deadline (`start_timeout`, twice with an `on_start`, plus 5 s) if it is still busy: it is then killed and that is logged. One that raises is logged and not called again for that worker, and the start goes on. The same stages are the telemetry event `[:vllm_bridge, :worker, :progress]`, also on restarts | `nil` |
  | `:worker_module` | the Python module run with `-m`; it is always passed `--max-frame-bytes N` (and `--allow`, `--also-allow` (`modules:`), `--max-refs`, `--poll-us` when those are set), so a module of one's own must accept them | `"vllm_bridge.bridge.worker"` |
  """

  alias VllmBridge.DP.Rendezvous
  alias VllmBridge.Error
  alias VllmBridge.Worker.Launcher

  @defaults [
    size: 1,
    python_path: [],
    modules: [],
    allow: [],
    max_refs: nil,
    poll_us: 0,
    worker_env: [],
    dp: nil,
    on_start: nil,
    max_in_flight: 16,
    max_frame_bytes: VllmBridge.Worker.Launcher.default_max_frame_bytes(),
    queue_size: 1024,
    start_timeout: 60_000,
    cancel_grace: 5_000,
    shutdown_grace: 3_000,
    max_restarts: nil,
    max_seconds: 30,
    worker_module: "vllm_bridge.bridge.worker",
    log_level: :warning,
    progress: nil
  ]

  @log_levels [:debug, :info, :warning, :error]

  @keys [:python | Keyword.keys(@defaults)]

  @worker_env_forms "must be [{name, value}], fn index -> [{name, value}] end, or " <>
                      "{module, function, args} (called with the index first)"

  @on_start_forms ~s(must be {"module", "function", args} or {"module", "function", args, kwargs}) <>
                    " (the names strings, args a list, kwargs a map or keyword list)"

  @doc "The option names a pool accepts."
  @spec keys() :: [atom()]
  def keys, do: @keys

  @doc "Checks `opts` and fills in the defaults; `:bad_argument` naming a bad one."
  @spec validate(keyword()) :: {:ok, keyword()} | {:error, Error.t()}
  def validate(opts) when is_list(opts) do
    with :ok <- known(opts) do
      opts = Keyword.merge(@defaults, opts)

      with {:ok, python} <- python(opts),
           opts = Keyword.put(opts, :python, python),
           :ok <- each(opts),
           {:ok, dirs} <- python_path(opts[:python_path]),
           {:ok, dp} <- Rendezvous.for_pool(opts[:dp], opts[:size]),
           opts = Keyword.put(opts, :dp, dp),
           {:ok, envs} <- envs(opts, dirs) do
        size = opts[:size]

        {:ok,
         opts
         |> Keyword.update!(:max_restarts, &(&1 || 10 + 3 * size))
         |> Keyword.update!(:on_start, &on_start/1)
         |> Keyword.put(:envs, envs)}
      end
    end
  end

  def validate(other), do: bad("pool options must be a keyword list, got #{inspect(other)}")

  @python_env "VLLM_BRIDGE_PYTHON"

  @doc false
  # The interpreter when no python: option names one (nil when nothing does).
  @spec default_python() :: String.t() | nil
  def default_python,
    do: Application.get_env(:vllm_bridge, :python) || System.get_env(@python_env)

  @doc false
  # The interpreter `python` names (else the default's), as an absolute path: a path is
  # expanded against the current folder now (a release's workers must not depend on
  # where it was started from later), a bare command name (`python3`) is looked up on
  # PATH (returned as given when PATH has none: refused by the caller). nil when nothing
  # names one; a non-string is returned as given (refused later).
  @spec resolve_python(term()) :: term()
  def resolve_python(python) do
    case python || default_python() do
      python when is_binary(python) and python != "" ->
        if String.contains?(python, "/"),
          do: Path.expand(python),
          else: System.find_executable(python) || python

      other ->
        other
    end
  end

  # The interpreter: the option, else the application's config, else the environment
  # variable, read now (at run time, so a release picks up its host's). None of them is a
  # bad_argument that says how to give one.
  defp python(opts) do
    case resolve_python(opts[:python]) do
      nil ->
        bad(
          "no Python interpreter for the pool: pass python: \"/path/to/.venv/bin/python\" " <>
            "to it, set `config :vllm_bridge, python: ...` (config/runtime.exs), or set the " <>
            "environment variable #{@python_env}; the interpreter's environment must have " <>
            "the vllm_bridge package and torch installed (docs/USING.md)"
        )

      python when is_binary(python) ->
        # resolve_python/1 returns a bare name only when PATH has no such command.
        if String.contains?(python, "/"),
          do: {:ok, python},
          else: bad("pool option python: #{inspect(python)} is not a command found on PATH")

      other ->
        {:ok, other}
    end
  end

  # The folders of `python_path`, absolute, each checked to be a folder now: a typo would
  # otherwise surface as an import error in every worker.
  defp python_path(dirs), do: map_ok(dirs, &python_dir/1, "python_path")

  defp python_dir({app, path}) when is_atom(app) and is_binary(path) do
    case :code.lib_dir(app) do
      {:error, :bad_name} -> {:error, "#{inspect({app, path})}: no application #{inspect(app)}"}
      _ -> python_dir(Application.app_dir(app, path))
    end
  end

  defp python_dir(path) when is_binary(path) do
    dir = Path.expand(path)

    cond do
      String.contains?(path, ":") -> {:error, "#{inspect(path)} contains a ':'"}
      File.dir?(dir) -> {:ok, dir}
      true -> {:error, "#{inspect(path)} is not a folder (#{dir})"}
    end
  end

  defp python_dir(other),
    do: {:error, "an entry must be a path or {app, path}, got #{inspect(other, limit: 5)}"}

  # The environment of each worker as `[{name, value}]` strings (`:envs`, by index), with
  # the python_path folders in front of its PYTHONPATH (the one worker_env gives, else the
  # BEAM's, which the port would pass on).
  defp envs(opts, dirs) do
    map_ok(
      0..(opts[:size] - 1),
      fn i ->
        with {:ok, env} <- worker_env(opts[:worker_env], i),
             {:ok, env} <- with_dp(env, opts[:dp], i),
             do: {:ok, with_python_path(env, dirs)}
      end,
      "worker_env"
    )
  end

  # `fun` on each element, in order: `{:ok, results}`, or the first `{:error, why}` as a
  # bad_argument naming the option.
  defp map_ok(enum, fun, option) do
    Enum.reduce_while(enum, {:ok, []}, fn x, {:ok, acc} ->
      case fun.(x) do
        {:ok, y} -> {:cont, {:ok, [y | acc]}}
        {:error, why} -> {:halt, bad("pool option #{option}: #{why}")}
      end
    end)
    |> case do
      {:ok, acc} -> {:ok, Enum.reverse(acc)}
      error -> error
    end
  end

  defp worker_env(spec, i) do
    env =
      case spec do
        f when is_function(f, 1) -> f.(i)
        {m, f, a} -> apply(m, f, [i | a])
        list -> list
      end

    if is_list(env) and Enum.all?(env, &env_pair?/1) do
      env = Enum.map(env, fn {k, v} -> {to_string(k), to_string(v)} end)

      case for({k, _} <- env, k in Launcher.own_env(), do: k) |> Enum.uniq() do
        [] ->
          {:ok, env}

        own ->
          {:error,
           "worker #{i}'s environment sets #{Enum.join(own, ", ")}, which the launcher " <>
             "sets itself (its start-up stderr capture); leave #{if length(own) > 1, do: "them", else: "it"} out"}
      end
    else
      {:error, "worker #{i}'s environment must be [{name, value}], got #{inspect(env, limit: 8)}"}
    end
  rescue
    e -> {:error, "building worker #{i}'s environment failed: " <> Exception.message(e)}
  end

  # The DP rendezvous's variables after worker_env's, which may not set them too.
  defp with_dp(env, nil, _i), do: {:ok, env}

  defp with_dp(env, dp, i) do
    case for({k, _} <- env, k in Rendezvous.env_names(), do: k) |> Enum.uniq() do
      [] -> {:ok, env ++ Rendezvous.env(dp, i)}
      set -> {:error, "worker #{i}'s environment sets #{Enum.join(set, ", ")}, which dp: gives"}
    end
  end

  defp env_pair?({k, v}) when is_binary(k) or is_atom(k),
    do: is_binary(v) or is_atom(v) or is_number(v)

  defp env_pair?(_), do: false

  defp with_python_path(env, []), do: env

  defp with_python_path(env, dirs) do
    given =
      case List.keyfind(env, "PYTHONPATH", 0) do
        {_, v} -> v
        nil -> System.get_env("PYTHONPATH")
      end

    value = Enum.join(dirs ++ Enum.reject([given], &(&1 in [nil, ""])), ":")
    List.keystore(env, "PYTHONPATH", 0, {"PYTHONPATH", value})
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
  defp check(:python_path, v) when is_list(v), do: :ok
  defp check(:python_path, _), do: {:error, "must be a list of folders"}

  defp check(k, v) when k in [:allow, :modules] and is_list(v) do
    case Enum.find(v, &(not module_name?(&1))) do
      nil -> :ok
      bad -> {:error, "must be a list of dotted Python module names; #{inspect(bad)} is not one"}
    end
  end

  defp check(k, _) when k in [:allow, :modules],
    do: {:error, "must be a list of dotted Python module names"}

  defp check(:max_refs, nil), do: :ok
  defp check(:max_refs, v) when is_integer(v) and v >= 1, do: :ok
  defp check(:max_refs, _), do: {:error, "must be a positive integer"}
  defp check(:poll_us, v) when is_integer(v) and v >= 0 and v <= 10_000, do: :ok
  defp check(:poll_us, _), do: {:error, "must be an integer from 0 to 10000 (microseconds)"}
  defp check(:worker_env, f) when is_function(f, 1), do: :ok

  defp check(:worker_env, {m, f, a}) when is_atom(m) and is_atom(f) and is_list(a) do
    Code.ensure_loaded(m)

    if function_exported?(m, f, length(a) + 1),
      do: :ok,
      else: {:error, "#{inspect(m)}.#{f}/#{length(a) + 1} is not a function"}
  end

  defp check(:worker_env, v) when is_list(v) do
    if Enum.all?(v, &match?({k, _} when is_binary(k) or is_atom(k), &1)),
      do: :ok,
      else: {:error, @worker_env_forms}
  end

  defp check(:worker_env, _), do: {:error, @worker_env_forms}

  # Checked (with the pool's size) by Rendezvous.for_pool/2.
  defp check(:dp, _), do: :ok
  defp check(:on_start, nil), do: :ok
  defp check(:on_start, {m, f, args}), do: check(:on_start, {m, f, args, %{}})

  defp check(:on_start, {m, f, args, kwargs})
       when is_binary(m) and is_binary(f) and is_list(args) and
              (is_map(kwargs) or is_list(kwargs)) do
    cond do
      not module_name?(m) ->
        {:error, "#{inspect(m)} is not a dotted Python module name"}

      not module_name?(f) ->
        {:error, "#{inspect(f)} is not a name (or dotted path) of the module's"}

      true ->
        # Arguments that cannot be sent are refused now, not by every worker's start.
        case VllmBridge.Call.Wire.encode_invoke({m, f}, args, kwargs) do
          {:ok, _parts} -> :ok
          {:error, e} -> {:error, "its arguments cannot be sent: #{e.message}"}
        end
    end
  end

  defp check(:on_start, _), do: {:error, @on_start_forms}

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

  defp check(:log_level, v) when v in @log_levels, do: :ok

  defp check(:log_level, _),
    do: {:error, "must be one of #{inspect(@log_levels)} (the Python root logger's level)"}

  defp check(:progress, nil), do: :ok
  defp check(:progress, f) when is_function(f, 1), do: :ok

  defp check(:progress, {m, f, a}) when is_atom(m) and is_atom(f) and is_list(a) do
    if Code.ensure_loaded?(m) and function_exported?(m, f, length(a) + 1),
      do: :ok,
      else: {:error, "names #{inspect(m)}.#{f}/#{length(a) + 1}, which does not exist"}
  end

  defp check(:progress, _),
    do:
      {:error,
       "must be a 1-arity function or {module, function, args} (called with the stage info first)"}

  defp check(:worker_module, v) when is_binary(v), do: :ok
  defp check(:worker_module, _), do: {:error, "must be a module name"}

  # on_start in its one form: {module, function, args, kwargs}, or nil.
  defp on_start(nil), do: nil
  defp on_start({m, f, args}), do: {m, f, args, %{}}
  defp on_start({_m, _f, _args, _kwargs} = full), do: full

  # A dotted Python module name: identifiers (ASCII, as the worker checks `--allow`).
  defp module_name?(name) when is_binary(name),
    do: name =~ ~r/\A[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*\z/

  defp module_name?(_), do: false

  defp bad(message), do: {:error, Error.new(:bad_argument, message)}
end
