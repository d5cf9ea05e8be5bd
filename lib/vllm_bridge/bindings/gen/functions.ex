defmodule VllmBridge.Bindings.Gen.Functions do
  @moduledoc false
  # Elixir source of one bound function: its spec attribute, options type, and one clause
  # per arity (required parameters, then each optional one positionally, then the options,
  # the rule of `VllmBridge.Bindings`), each with `@doc` and `@spec`; for a context manager
  # also the `with_…` clauses.

  alias VllmBridge.Bindings.Gen.{Docs, Model, Values}
  alias VllmBridge.Bindings.Type

  @doc "The source of `fun` (a `Model.function_model()`)."
  @spec render(Model.function_model(), Model.classes()) :: String.t()
  def render(fun, classes) do
    attr = attribute(fun)
    opts_type = "#{fun.name}_opts"

    [
      "@#{attr} #{inspect(Model.binding_spec(fun), limit: :infinity, printable_limit: :infinity)}",
      options_type(fun, opts_type),
      plain_clauses(fun, attr, opts_type, classes),
      if(fun.kind == :enter, do: with_clauses(fun, attr, opts_type), else: [])
    ]
    |> List.flatten()
    |> Enum.join("\n\n")
  end

  @doc "The module attribute that holds a function's binding spec."
  @spec attribute(Model.function_model()) :: String.t()
  def attribute(fun), do: "binding_" <> fun.name

  @doc "The `{:ok, t} | {:error, ...}` typespec of what `fun`'s plain form returns."
  @spec result_spec(Model.function_model()) :: String.t()
  def result_spec(%{kind: :enter} = fun),
    do: "{:ok, {VllmBridge.Ref.t(), #{Type.spec(fun.returns)}}} | {:error, VllmBridge.Error.t()}"

  def result_spec(fun), do: "{:ok, #{Type.spec(fun.returns)}} | {:error, VllmBridge.Error.t()}"

  # -- the options type ---------------------------------------------------------------------

  defp options_type(fun, name) do
    named =
      for p <- fun.params,
          p.mode in [:optional, :keyword],
          do: "{#{inspect(String.to_atom(p.py))}, #{Type.spec(p.type)}}"

    extra = if fun.var_keyword, do: ["{atom(), term()}"], else: []
    all = named ++ extra ++ ["{:__runtime__, VllmBridge.Runtime.opts()}"]

    """
    @typedoc "Options of `#{fun.name}`: #{if named == [], do: "", else: "optional parameters by name and "}`__runtime__` (see `VllmBridge.Bindings`)."
    @type #{name} :: [#{Enum.join(all, " | ")}]
    """
    |> String.trim_trailing()
  end

  # -- plain clauses ------------------------------------------------------------------------

  defp plain_clauses(fun, attr, opts_type, classes) do
    {fixed, optional} = split_params(fun)
    n = length(fixed)
    call = call_fun(fun)
    result = result_spec(fun)

    for k <- 0..(length(optional) + 1) do
      {vars, types} = arguments(fixed, optional, k, opts_type)
      doc = if k == 0, do: main_doc(fun, classes), else: arity_doc(fun, n, optional, k)

      """
      @doc #{doc}
      @spec #{fun.name}(#{Enum.join(types, ", ")}) :: #{result}
      def #{fun.name}(#{Enum.join(vars, ", ")}), do: VllmBridge.Bindings.#{call}(@#{attr}, [#{Enum.join(vars, ", ")}])
      """
      |> String.trim_trailing()
    end
  end

  defp call_fun(%{kind: :call}), do: "call"
  defp call_fun(%{kind: :enter}), do: "enter"
  defp call_fun(%{kind: :get}), do: "get"

  # k = 0: required only; 1..m: the k-th optional or the options last; m + 1: options.
  defp arguments(fixed, optional, k, opts_type) do
    m = length(optional)
    head = fixed ++ Enum.take(optional, max(k - 1, 0))
    vars = Enum.map(head, & &1.var)
    types = Enum.map(head, &Type.spec(&1.type))

    cond do
      k == 0 ->
        {vars, types}

      k <= m ->
        p = Enum.at(optional, k - 1)
        {vars ++ ["#{p.var}_or_opts"], types ++ ["#{Type.spec(p.type)} | #{opts_type}()"]}

      true ->
        {vars ++ ["opts"], types ++ ["#{opts_type}()"]}
    end
  end

  defp split_params(fun) do
    {Enum.filter(fun.params, &(&1.mode in [:required, :required_keyword])),
     Enum.filter(fun.params, &(&1.mode in [:optional, :positional_only]))}
  end

  defp main_doc(fun, classes) do
    body = if fun.doc == "", do: "Python binding for `#{fun.python}`.", else: fun.doc

    params =
      for p <- fun.params do
        facts =
          [
            "`#{Type.spec(p.type)}`",
            case p.default do
              {:ok, v} -> "default #{Values.doc(v, classes)}"
              :error -> nil
            end,
            case p.mode do
              :keyword -> "by name only"
              :positional_only -> "positionally only"
              :required_keyword -> "sent by name"
              _ -> nil
            end
          ]
          |> Enum.reject(&is_nil/1)
          |> Enum.join(", ")

        name = if p.mode in [:required, :required_keyword], do: p.var, else: p.py
        "  * `#{name}` (#{facts})" <> if(p.doc, do: " - #{p.doc}", else: "")
      end

    # The docstring's Returns/Yields text goes under the generated Returns.
    {returned, others} =
      Enum.split_with(fun.sections, fn {name, _} -> name in ["Returns", "Yields"] end)

    returns = Enum.join([returns_doc(fun) | Enum.map(returned, &elem(&1, 1))], "\n\n")

    sections =
      [
        body,
        if(params != [], do: "## Parameters\n\n" <> Enum.join(params, "\n")),
        "## Returns\n\n" <> returns
      ] ++ Enum.map(others, fn {name, md} -> "## #{name}\n\n#{md}" end) ++ [footer(fun)]

    sections |> Enum.reject(&is_nil/1) |> Enum.join("\n\n") |> Docs.heredoc()
  end

  defp returns_doc(%{kind: :enter} = fun) do
    {fixed, _} = split_params(fun)

    "`{:ok, {handle, value}}`: the context manager is entered (in the call's session) and " <>
      "`value` (`#{Type.spec(fun.returns)}`) is what it yields; leave it with " <>
      "`VllmBridge.exit(handle, nil, session_id: ...)`. " <>
      "`with_#{fun.name}/#{length(fixed) + 1}` enters, runs a function and always exits."
  end

  defp returns_doc(fun), do: "`#{Type.spec(fun.returns)}`"

  defp footer(fun) do
    defined =
      case fun.defined_in do
        nil ->
          ""

        mod ->
          if String.starts_with?(fun.python, mod <> "."), do: "", else: " (defined in `#{mod}`)"
      end

    skipped =
      if fun.var_positional,
        do: " Its `*#{fun.var_positional}` takes no values from Elixir.",
        else: ""

    "Binds `#{fun.python}`#{defined}.#{skipped} Arguments and options: `VllmBridge.Bindings`; " <>
      "runtime options (`__runtime__:`): `VllmBridge.Runtime`."
  end

  defp arity_doc(fun, n, optional, k) do
    m = length(optional)
    like = "Like `#{fun.name}/#{n}`,"
    see = "(see `VllmBridge.Bindings`)."

    text =
      cond do
        m == 0 ->
          "#{like} with the options as the last argument #{see}"

        k > m ->
          "#{like} with every optional parameter positionally, then the options #{see}"

        true ->
          p = Enum.at(optional, k - 1)
          before = optional |> Enum.take(k - 1) |> Enum.map_join(", ", &"`#{&1.py}`")
          lead = if before == "", do: "", else: " with #{before} positionally,"
          "#{like}#{lead} the last argument being `#{p.py}` or the options #{see}"
      end

    inspect(text)
  end

  # -- with_ clauses ------------------------------------------------------------------------

  defp with_clauses(fun, attr, opts_type) do
    {fixed, optional} = split_params(fun)
    n = length(fixed)
    value = Type.spec(fun.returns)
    fun_type = "(#{value} -> result) | (#{value}, VllmBridge.Session.t() -> result)"

    for k <- 0..(length(optional) + 1) do
      {vars, types} = arguments(fixed, optional, k, opts_type)

      doc =
        if k == 0 do
          Docs.heredoc(
            "Enters `#{fun.name}`'s context manager in a session, calls `fun` with what it " <>
              "yields (`#{value}`), and the session when `fun` takes two arguments, and always " <>
              "exits, on one worker. Returns `{:ok, fun_result}`; an error raised in `fun` " <>
              "reaches Python's `__exit__` and is re-raised here. The session is the one of " <>
              "`__runtime__: [session_id: s]`, else the current one, else a temporary one; calls " <>
              "from `fun` run in it. Arguments as for " <>
              "`#{fun.name}/#{n}`; see \"Context managers\" in `VllmBridge.Bindings`."
          )
        else
          inspect("`with_#{fun.name}/#{n + 1}` with the arguments of `#{fun.name}/#{n + k}`.")
        end

      """
      @doc #{doc}
      @spec with_#{fun.name}(#{Enum.join(types ++ [fun_type], ", ")}) :: {:ok, result | nil} | {:error, VllmBridge.Error.t()} when result: term()
      def with_#{fun.name}(#{Enum.join(vars ++ ["fun"], ", ")}), do: VllmBridge.Bindings.with_context(@#{attr}, [#{Enum.join(vars, ", ")}], fun)
      """
      |> String.trim_trailing()
    end
  end
end
