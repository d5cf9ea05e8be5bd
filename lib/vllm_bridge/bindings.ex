defmodule VllmBridge.Bindings do
  @moduledoc """
  The calling conventions of the generated bindings (`Vllm.*`, written by
  `mix vllm.gen.bindings` from the Python package), and the functions their code calls.

  ## Arguments

  A Python function `f(a, b, c=1, d=None, *, e=0)` becomes `f/2..5`:

    * required parameters are positional, always (`a`, `b`); a keyword-only parameter
      without default is positional too, after them, and is sent by name;
    * optional parameters may follow positionally, in Python's order (`c`, `d`) — the
      arity range of the function;
    * or any optional parameter is given by name in a trailing keyword list, which also
      carries the runtime options: `f(a, b, d: 4, e: 1, __runtime__: [timeout: 5_000])`.
      Keyword-only parameters (`e`) can only be given there, positional-only ones only
      positionally.

  **The last argument.** At the largest arity (`f/5`: every optional parameter given) the
  last argument is the options, and must be a keyword list. At the arities between
  (`f/3`, `f/4`) the last argument is the options exactly when it is a keyword list — a
  list of `{atom, value}` pairs, `[]` included — and otherwise the next optional
  parameter. A keyword list there is never taken for a positional value: its keys must
  all name optional parameters not already given positionally (or `:__runtime__`), else
  the call fails with `:bad_argument` naming them. To pass a keyword list, or `[]`, as the
  value of an optional parameter, put an options list after it: `f(a, b, [], [])` gives
  `c = []` and no options. Other mistakes are `:bad_argument` errors too: an unknown
  option, a parameter given both positionally and by name, an option given twice, a
  wrong number of arguments.

  **Types.** Every argument is checked against its parameter's type hint before anything
  is sent, and a mismatch is `:bad_argument` naming the
  parameter, the expected type and the value. Python then checks values (ranges,
  consistency) and answers a refusal as `:python_exception` (or `:bad_argument` for a
  dataclass that refuses its fields).

  **Results.** Every generated function returns `{:ok, value}` or
  `{:error, %VllmBridge.Error{}}`; values are decoded by `VllmBridge.Codec` (structs for
  the dataclasses, atoms for enum members, `VllmBridge.Tensor`s, `VllmBridge.Ref`s for
  objects that cannot travel by value). The bindings assume workers started with the
  default allow-list (`vllm_bridge.PUBLIC_MODULES`): from a worker that leaves a module
  out, that module's dataclasses come back as references instead of structs. The demo's
  `Vllm.Demo.Rank.Module` is not on it (it writes and reads files): its calls need a pool
  with `modules: ["vllm_bridge.demo.rank"]`, and are refused by name elsewhere.

  ## Classes

  A dataclass `C` becomes a struct module (`Vllm.ForwardContext.BatchDescriptor`) and an
  enum a module whose `t()` is the union of its members' atoms
  (`Vllm.Cudagraph.CUDAGraphMode`). Their public methods are functions of that module
  whose first argument is the instance (`DPMetadata.cu_tokens_across_sp(meta, 2)`,
  `CUDAGraphMode.has_mode(:full_and_piecewise, :piecewise)`); static methods take no
  instance; a property is a function of the instance (`UBatchSlice.num_tokens(slice)`).
  The instance is sent by value: a method that changes it changes Python's copy.

  ## Runtime options

  `__runtime__:` takes the options of `VllmBridge.Runtime` (`timeout`, `timeout_profile`,
  `stream_timeout`, `session_id`, `pool_name`, `affinity`, `node`), documented there once.

  ## Module attributes

  A Python module attribute `x` becomes `x/0..1` (`x(__runtime__: [...])`): it is read
  when called, in the worker (and session) the call runs on.

  ## Context managers

  A `@contextmanager` function `cm(...)` gets two forms:

    * `cm(...)` enters it and returns `{:ok, {handle, value}}`, `value` being what it
      yields; the context stays entered in the call's session (`__runtime__:
      [session_id: s]` or the process's current session; with neither, the call is
      refused) until `VllmBridge.exit(handle)`, or until the session closes;
    * `with_cm(..., fun)` takes the same arguments followed by a function. It enters the
      context in a session, calls `fun.(value)` or `fun.(value, session)` and always
      exits, on the same worker. The session is the one named by
      `__runtime__: [session_id: s]`, else the process's current one, else a temporary one
      (opened on the call's pool, closed afterwards). While `fun` runs that session is the
      process's current one, so calls from `fun` that name no session see the context
      (`VllmBridge.Session.current/0`). Returns `{:ok, fun_result}`; when `fun`
      raises, throws or exits, Python's `__exit__` receives the error and the error is
      re-raised in the caller (unless `__exit__` suppressed it: then `{:ok, nil}`).
  """

  alias VllmBridge.Bindings.Args
  alias VllmBridge.Call.{Run, Runtime, Wire}
  alias VllmBridge.{Error, Session}

  @typedoc """
  What a generated function passes to describe one Python function or attribute: its
  target, name and parameters (built by the generated code; not written by hand).
  """
  @type spec :: Args.spec()

  @doc "Calls the Python function of `spec` with the Elixir `args` of a generated function."
  @spec call(spec(), list()) :: {:ok, term()} | {:error, Error.t()}
  def call(spec, args) do
    # VllmBridge.call/4's steps, the target's encoding kept once per binding
    # (`Wire.encode_invoke_binding/3`).
    # (Large tensors may go through shared memory, as in VllmBridge.call/4.)
    with {:ok, py_args, kwargs, runtime} <- Args.split(spec, args),
         {:ok, rt} <- Runtime.resolve(runtime) do
      bound = Run.bound_ref(spec.target)
      payload = {py_args, kwargs}

      Run.run_encoded(
        rt,
        "call",
        fn -> Wire.encode_invoke_binding(spec.target, py_args, kwargs) end,
        what: spec.target,
        bound: bound,
        payload: payload
      )
    end
  end

  @doc "Reads the Python module attribute of `spec` (`args`: `[]` or `[options]`)."
  @spec get(spec(), list()) :: {:ok, term()} | {:error, Error.t()}
  def get(spec, args) do
    with {:ok, [], kwargs, runtime} when kwargs == %{} <- Args.split(spec, args) do
      VllmBridge.get(spec.target, runtime)
    end
  end

  @doc "Enters the context manager of `spec`: `{:ok, {handle, value}}`."
  @spec enter(spec(), list()) ::
          {:ok, {VllmBridge.Ref.t(), term()}} | {:error, Error.t()}
  def enter(spec, args) do
    with {:ok, py_args, kwargs, runtime} <- Args.split(spec, args) do
      VllmBridge.enter(spec.target, py_args, kwargs, runtime)
    end
  end

  @doc """
  The `with_…` form of the context manager of `spec`: enters in a session, runs `fun`,
  always exits (see the moduledoc).
  """
  @spec with_context(spec(), list(), function()) :: {:ok, term()} | {:error, Error.t()}
  def with_context(spec, args, fun) when is_function(fun, 1) or is_function(fun, 2) do
    with {:ok, py_args, kwargs, runtime} <- Args.split(with_spec(spec), args, 1),
         :ok <- runtime_list(spec, args, runtime) do
      # VllmBridge.with_context picks the session (the given one, the current one, or a
      # temporary one) and makes it current while the body runs.
      body = if is_function(fun, 2), do: &fun.(&1, Session.current()), else: fun
      VllmBridge.with_context(spec.target, py_args, kwargs, runtime, body)
    end
  end

  def with_context(spec, args, other) do
    {:error,
     Error.new(
       :bad_argument,
       "#{with_spec(spec).name}/#{length(args) + 1}: the last argument must be a function of 1 or 2 " <>
         "arguments (the entered value, and the session), got #{inspect(other, limit: 5)}"
     )}
  end

  # The spec of the with_ form: its name, for messages.
  defp with_spec(spec) do
    {module, [name]} = spec.name |> String.split(".") |> Enum.split(-1)
    %{spec | name: Enum.join(module ++ ["with_" <> name], ".")}
  end

  defp runtime_list(_spec, _args, runtime) when is_list(runtime), do: :ok

  defp runtime_list(spec, args, runtime),
    do:
      {:error,
       Error.new(
         :bad_argument,
         "#{with_spec(spec).name}/#{length(args) + 1}: __runtime__ must be a keyword list, got " <>
           inspect(runtime, limit: 5)
       )}
end
