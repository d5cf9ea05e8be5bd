defmodule VllmBridge.Call.Context do
  @moduledoc false
  # VllmBridge's context managers and scoped bodies, behind the facade's thin functions
  # (whose docs say what they do): `enter/4` and `exit/3`; `with_context/5`, a body run
  # between an enter and an exit that always runs; `with_session/2`, a body run between a
  # session's open and close (which `with_context/5` opens when it is given no session);
  # and the error an exit hands to `__exit__`. Apart from the facade so that VllmBridge
  # holds the API and its docs, and this module how each of these runs.

  alias VllmBridge.{Error, Ref, Session}
  alias VllmBridge.Call.{Run, Runtime, Wire}
  alias VllmBridge.Session.LooseRefs

  @doc "See `VllmBridge.enter/4`."
  @spec enter(term(), list(), map() | keyword(), VllmBridge.Runtime.opts()) ::
          {:ok, {Ref.t(), term()}} | {:error, Error.t()}
  def enter(target, args, kwargs, opts) do
    with {:ok, rt} <- Runtime.resolve(opts),
         :ok <- in_a_session(rt, target),
         {:ok, parts} <- Wire.encode_invoke(target, args, kwargs),
         {:ok, answer} <-
           Run.run(rt, "enter", parts, what: target, bound: Run.bound_ref(target)) do
      entered(rt, answer)
    end
  end

  defp entered(_rt, [handle, value]), do: {:ok, {handle, value}}

  defp entered(rt, other) do
    # Nobody will hold this value: what it references is released, not kept.
    VllmBridge.Call.Release.drop(rt, other)
    {:error, Error.new(:protocol, "enter answered #{inspect(other, limit: 5)}")}
  end

  # A context entered in no session would sit in the worker's shared default session,
  # seen by every later session-less call that lands on that worker: refused.
  defp in_a_session(%Runtime{session_id: id}, _target) when is_binary(id), do: :ok
  defp in_a_session(_rt, {%Ref{}, _path}), do: :ok

  defp in_a_session(_rt, target) do
    {:error,
     Error.new(
       :bad_argument,
       "enter of #{inspect(target, limit: 5)} needs a session (a context belongs to one): " <>
         "pass session_id: in the runtime options, or use with_context/5 or a with_… " <>
         "binding, which open one for the body"
     )}
  end

  @doc "See `VllmBridge.exit/3`."
  @spec exit(term(), term(), VllmBridge.Runtime.opts()) ::
          {:ok, boolean()} | {:error, Error.t()}
  def exit(%Ref{} = handle, exc, opts) do
    with {:ok, rt} <- Runtime.resolve(opts),
         {:ok, exc_map} <- exc_map(exc) do
      parts = [Wire.value(handle), Wire.value(exc_map)]

      with {:ok, _} = ok <- Run.run(rt, "exit", parts, what: handle, bound: handle) do
        LooseRefs.forget([handle])
        ok
      end
    end
  end

  def exit(other, _exc, _opts),
    do:
      {:error,
       Error.new(
         :bad_argument,
         "exit needs a context handle (a Ref), got #{inspect(other, limit: 5)}"
       )}

  @doc "See `VllmBridge.with_context/5`."
  @spec with_context(term(), list(), map() | keyword(), VllmBridge.Runtime.opts(), term()) ::
          term()
  def with_context(target, args, kwargs, opts, fun) when is_function(fun, 1) do
    with {:ok, rt} <- Runtime.resolve(opts) do
      case {rt.session_id, target} do
        {nil, {%Ref{}, _}} ->
          with_context_in(nil, target, args, kwargs, opts, fun)

        {nil, _} ->
          # No session given: a temporary one, in the pool the options name, for the body.
          with_session(
            fn s ->
              opts = Keyword.put(opts || [], :session_id, s.id)
              with_context_in(s, target, args, kwargs, opts, fun)
            end,
            Keyword.take(opts || [], [:pool_name, :node])
          )

        {id, _} ->
          with {:ok, s} <- Session.lookup(id),
               do: with_context_in(s, target, args, kwargs, opts, fun)
      end
    end
  end

  def with_context(_target, _args, _kwargs, _opts, other),
    do: not_a_function("with_context", "the entered value", other)

  @doc "See `VllmBridge.with_session/2`."
  @spec with_session(term(), keyword()) :: term()
  def with_session(fun, opts) when is_function(fun, 1) do
    with {:ok, session} <- Session.open(opts) do
      try do
        Session.with_current(session, fn -> fun.(session) end)
      after
        Session.close(session)
      end
    end
  end

  def with_session(other, _opts), do: not_a_function("with_session", "the session", other)

  defp not_a_function(name, argument, other) do
    {:error,
     Error.new(
       :bad_argument,
       "#{name} needs a function of one argument (#{argument}), got #{inspect(other, limit: 5)}"
     )}
  end

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

    with {:ok, {handle, value}} <- enter(target, args, kwargs, opts) do
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
          case exit(handle, nil, exit_opts) do
            {:ok, _suppressed} -> {:ok, result}
            {:error, e} -> {:error, e}
          end
      end
    end
  end

  defp exit_after_failure(handle, exc, opts, kind, reason, stack) do
    case exit(handle, exc, opts) do
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
