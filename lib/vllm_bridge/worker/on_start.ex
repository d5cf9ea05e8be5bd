defmodule VllmBridge.Worker.OnStart do
  @moduledoc false
  # The pool option `on_start`, the last stage of a worker's start
  # (VllmBridge.Worker.Starting): the request it sends, and the errors that name it.
  #
  # The request is an ordinary `call` (no session) with the starting worker's own alias as
  # its caller: written through the worker's table of calls (VllmBridge.Worker.submit/2),
  # it passes the worker's guard like any call, and its reply comes back to that alias.

  alias VllmBridge.Call.{Request, Runtime, Wire}
  alias VllmBridge.Error

  @typedoc "`{module, function, args, kwargs}`, as VllmBridge.Pool.Options checked it."
  @type t :: {String.t(), String.t(), list(), map() | keyword()}

  @doc false
  # The request of `on_start`, due within `timeout` ms: the alias its reply comes to, and
  # what Worker.submit/2 takes; an error when its arguments cannot be encoded.
  @spec request(t(), non_neg_integer()) :: {:ok, reference(), term()} | {:error, Error.t()}
  def request({m, f, args, kwargs}, timeout) do
    with {:ok, parts} <- Wire.encode_invoke({m, f}, args, kwargs) do
      deadline = Runtime.deadline(System.monotonic_time(:millisecond), timeout)
      req = Request.new("call", pre: [Wire.value(nil)], post: parts, target: {m, f})
      alias = :erlang.alias()
      {:ok, alias, Request.submit(req, :erlang.unique_integer([:positive]), alias, deadline)}
    end
  end

  @doc false
  # The error of an on_start that did not return within `timeout` ms.
  @spec timed_out(non_neg_integer()) :: Error.t()
  def timed_out(timeout) do
    Error.new(
      :timeout,
      "it did not return within #{timeout} ms (start_timeout); the Python process was killed"
    )
  end

  @doc false
  # An on_start that failed, named: the callable, the error's own words (and its Python
  # type and traceback) kept, and a hint when its module is not on the allow-list.
  @spec error(t(), Error.t()) :: Error.t()
  def error({m, f, _args, _kwargs}, %Error{} = e) do
    hint =
      if e.type == :bad_argument and not_allowed?(e.message, m),
        do: " (a module of one's own goes on it with the pool option modules: [#{inspect(m)}])",
        else: ""

    %{e | message: "on_start #{m}.#{f} failed: #{e.message}#{hint}"}
  end

  # Whether the worker refused on_start's module itself as not allow-listed (its words:
  # vllm_bridge.bridge.worker.targets), and not, say, a value or path of an allow-listed
  # module that reaches a module outside the list (the guard's words), which modules:
  # would not cure. A module name is dotted identifiers (checked by the options), so
  # Python's repr of it is the name in single quotes.
  defp not_allowed?(message, m),
    do: String.starts_with?(message, "module '#{m}' is not in the worker's allow-list")
end
