defmodule VllmBridge.Call.Context do
  @moduledoc false
  # The plumbing of VllmBridge's context managers: `with_context/5`'s body run between
  # an enter and an exit that always runs, and the error an exit hands to `__exit__`.

  alias VllmBridge.{Error, Session}

  # Enter, run `fun` with the session as this process's current one, always exit.
  @spec with_context_in(
          Session.t() | nil,
          term(),
          list(),
          map() | keyword(),
          keyword(),
          (term() -> term())
        ) :: term()
  def with_context_in(session, target, args, kwargs, opts, fun) do
    body = if session, do: fn v -> Session.with_current(session, fn -> fun.(v) end) end, else: fun

    with {:ok, {handle, value}} <- VllmBridge.enter(target, args, kwargs, opts) do
      # The exit must run: it waits for the context's worker whatever the call's affinity
      # (under :strict_fail_fast a busy worker would otherwise leave the context entered).
      exit_opts =
        (opts || []) |> Keyword.drop([:pool_name]) |> Keyword.put(:affinity, :strict_queue)

      try do
        body.(value)
      rescue
        e ->
          exit_after_failure(handle, e, exit_opts, :error, e, __STACKTRACE__)
      catch
        kind, reason ->
          message = "#{kind}: #{inspect(reason, limit: 8)}"
          exit_after_failure(handle, message, exit_opts, kind, reason, __STACKTRACE__)
      else
        result ->
          case VllmBridge.exit(handle, nil, exit_opts) do
            {:ok, _suppressed} -> {:ok, result}
            {:error, e} -> {:error, e}
          end
      end
    end
  end

  defp exit_after_failure(handle, exc, opts, kind, reason, stack) do
    case VllmBridge.exit(handle, exc, opts) do
      {:ok, true} -> {:ok, nil}
      _ -> :erlang.raise(kind, reason, stack)
    end
  end

  @spec exc_map(term()) :: {:ok, map() | nil} | {:error, Error.t()}
  def exc_map(nil), do: {:ok, nil}
  def exc_map(%Error{} = e), do: {:ok, Error.to_wire(e)}

  def exc_map(e) when is_exception(e),
    do:
      {:ok,
       %{
         "type" => "python_exception",
         "message" => Exception.message(e),
         "python_type" => inspect(e.__struct__),
         "traceback" => nil,
         "exc_id" => nil
       }}

  def exc_map(message) when is_binary(message),
    do:
      {:ok,
       %{
         "type" => "python_exception",
         "message" => message,
         "python_type" => nil,
         "traceback" => nil,
         "exc_id" => nil
       }}

  def exc_map(other),
    do:
      {:error,
       Error.new(
         :bad_argument,
         "exit's error must be nil, an exception or a message, got #{inspect(other, limit: 5)}"
       )}
end
