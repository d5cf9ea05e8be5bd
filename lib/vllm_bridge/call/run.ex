defmodule VllmBridge.Call.Run do
  @moduledoc false
  # The common path of every call of VllmBridge: route, reserve, send, wait. The options
  # were resolved once (VllmBridge.Call.Runtime); the arguments were encoded in the
  # caller's process before anything is reserved (VllmBridge.Call.Wire).

  alias VllmBridge.{Error, Ref}
  alias VllmBridge.Call.{Request, Route, Runtime, Wire}
  alias VllmBridge.Session.LooseRefs

  # `what:` the target the request runs (`{module, path}` or `{ref, path}`), or a short
  # description (for a release); `bound:` the reference it is bound to (nil when none);
  # `payload:` its arguments, looked at only to see whether they hold references
  # (VllmBridge.Call.Route); `timed:` whether the kind carries a timeout field (default
  # true).
  @type opts :: [what: term(), bound: Ref.t() | nil, payload: term(), timed: boolean()]

  # Kinds that clean up session state: once sent they are never cancelled (not at the
  # deadline, not when the caller dies) and carry no deadline to the worker, which runs
  # requests in arrival order. A caller that stops waiting gets :timeout, and the
  # session's next call still finds the context exited.
  @cleanups ["exit", "release"]

  @doc "Runs a request of `kind` whose encoded fields are `parts` (`t:opts/0`)."
  @spec run(Runtime.t(), String.t(), [iodata()], opts()) :: {:ok, term()} | {:error, Error.t()}
  def run(%Runtime{} = rt, kind, parts, opts) do
    what = Keyword.fetch!(opts, :what)

    result =
      with {:ok, route} <-
             Route.resolve(rt, kind, Keyword.get(opts, :bound), Keyword.get(opts, :payload)),
           req =
             Request.new(kind,
               pre: [Wire.value(route.session_id)],
               post: parts,
               timed: Keyword.get(opts, :timed, true),
               target: what
             ),
           {:ok, pid, _index} <- Route.checkout(route, req, rt.deadline) do
        if kind in @cleanups do
          pid
          |> Request.send_request(req, :infinity, holds_slot: true, cancel_on_caller_exit: false)
          |> Request.await(rt.deadline, on_timeout: :forget)
        else
          pid |> Request.call(req, rt.deadline, holds_slot: true) |> adopt_loose(route)
        end
      end

    case result do
      {:error, %Error{type: :timeout} = e} -> {:error, timed_out(e, kind, what, rt)}
      other -> other
    end
  end

  @doc "The reference a target is bound to (`{%Ref{}, path}`), or nil."
  @spec bound_ref(term()) :: Ref.t() | nil
  def bound_ref({%Ref{} = ref, _path}), do: ref
  def bound_ref(_), do: nil

  # References a call outside any session brought back belong to the calling process
  # (VllmBridge.Session.LooseRefs): released when it exits.
  defp adopt_loose({:ok, value} = result, %Route{session_id: nil}) do
    LooseRefs.track(self(), Ref.collect(value, session: :none))
    result
  end

  defp adopt_loose(result, _route), do: result

  # A timeout names what timed out and the timeout it had.
  defp timed_out(e, kind, what, rt),
    do: %{e | message: "#{kind} #{describe(what)}: #{e.message} (timeout #{rt.timeout} ms)"}

  defp describe({module, path}) when is_binary(module), do: "#{module}.#{path}"
  defp describe({%Ref{} = ref, nil}), do: "reference #{ref.id} (#{ref.type})"
  defp describe({%Ref{} = ref, path}), do: "reference #{ref.id} (#{ref.type}).#{path}"
  defp describe(%Ref{} = ref), do: "of reference #{ref.id} (#{ref.type})"
  defp describe(text) when is_binary(text), do: text
end
