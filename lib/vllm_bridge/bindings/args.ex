defmodule VllmBridge.Bindings.Args do
  @moduledoc false
  # How a generated function's Elixir arguments become the Python call's positional
  # arguments, keyword arguments and runtime options (the rule of `VllmBridge.Bindings`).
  #
  # A function is described by a map (generated into its module as an attribute):
  #
  #   * `name` - the Elixir function, `"Vllm.ForwardContext.Module.set_forward_context"`;
  #   * `target` - `{python_module, attribute_path}`;
  #   * `params` - `{python_name, mode, type}` in Elixir argument order, where `mode` is
  #     `:required` (positional), `:required_keyword` (positional in Elixir, sent by name:
  #     a keyword-only Python parameter without default), `:optional` (positionally or by
  #     name), `:positional_only` (optional, positionally only) or `:keyword` (optional,
  #     by name only); `type` a `VllmBridge.Bindings.Type` descriptor;
  #   * `var_keyword` - whether the Python function takes `**kwargs` (then any option name
  #     is passed on).

  alias VllmBridge.Bindings.Type
  alias VllmBridge.Error

  @typedoc "One parameter: Python name, mode, type descriptor."
  @type param ::
          {atom(), :required | :required_keyword | :optional | :positional_only | :keyword,
           Type.t()}

  @typedoc "A generated function's description."
  @type spec :: %{
          required(:name) => String.t(),
          required(:target) => {String.t(), String.t()},
          required(:params) => [param()],
          optional(:var_keyword) => boolean()
        }

  @doc """
  Splits a call's Elixir arguments: `{:ok, python_args, python_kwargs, runtime_opts}`, or a
  `:bad_argument` error naming what is wrong. `more` is the number of arguments the
  Elixir function takes after these (the function of a `with_…` form), for messages.
  """
  @spec split(spec(), list(), non_neg_integer()) ::
          {:ok, list(), %{String.t() => term()}, keyword()} | {:error, Error.t()}
  def split(spec, args, more \\ 0) do
    case quick(spec.params, args) do
      {:ok, _, _, _} = ok -> ok
      :slow -> full_split(spec, args, more)
    end
  end

  # The common shapes, without building anything: every parameter required and given
  # (type-checked), then nothing or `[__runtime__: opts]` alone. Anything else, and every
  # error (for its message), takes the full path.
  defp quick([], []), do: {:ok, [], %{}, []}
  defp quick([], [[__runtime__: rt]]) when is_list(rt), do: {:ok, [], %{}, rt}

  defp quick(params, args) do
    case quick_args(params, args, []) do
      {:ok, values, rt} -> {:ok, values, %{}, rt}
      :slow -> :slow
    end
  end

  defp quick_args([{_, :required, type} | params], [value | args], acc) do
    if Type.check(type, value), do: quick_args(params, args, [value | acc]), else: :slow
  end

  defp quick_args(params, [], acc) do
    if none_required?(params), do: {:ok, Enum.reverse(acc), []}, else: :slow
  end

  defp quick_args(params, [[__runtime__: rt]], acc) when is_list(rt) do
    if none_required?(params), do: {:ok, Enum.reverse(acc), rt}, else: :slow
  end

  defp quick_args(_params, _args, _acc), do: :slow

  defp none_required?(params),
    do: Enum.all?(params, fn {_, mode, _} -> mode not in [:required, :required_keyword] end)

  defp full_split(spec, args, more) do
    fixed =
      Enum.filter(spec.params, fn {_, mode, _} -> mode in [:required, :required_keyword] end)

    positional =
      Enum.filter(spec.params, fn {_, mode, _} -> mode in [:optional, :positional_only] end)

    n = length(fixed)
    m = length(positional)
    arity = length(args)

    {given, opts} =
      cond do
        arity == n ->
          {args, []}

        arity == n + m + 1 ->
          {Enum.drop(args, -1), List.last(args)}

        arity > n and arity <= n + m and keyword?(List.last(args)) ->
          {Enum.drop(args, -1), List.last(args)}

        true ->
          {args, []}
      end

    where = "#{spec.name}/#{arity + more}"
    {fixed_values, optional_values} = Enum.split(given, n)
    optional_given = Enum.take(positional, length(optional_values))

    with :ok <- check_arity(where, arity, n, n + m + 1, more),
         :ok <- check_opts(where, opts),
         {:ok, by_name, runtime} <- named(where, spec, opts, optional_given),
         :ok <- check_types(where, Enum.zip(fixed, fixed_values)),
         :ok <- check_types(where, Enum.zip(optional_given, optional_values)) do
      pairs = Enum.zip(fixed, fixed_values)

      py_args = for({{_, :required, _}, v} <- pairs, do: v) ++ optional_values

      kwargs =
        for(
          {{name, :required_keyword, _}, v} <- pairs,
          into: by_name,
          do: {Atom.to_string(name), v}
        )

      {:ok, py_args, kwargs, runtime}
    end
  end

  @doc """
  Whether a trailing argument is taken as the options: a list whose elements are all
  `{atom, value}` pairs (a keyword list; `[]` is one).
  """
  @spec keyword?(term()) :: boolean()
  def keyword?([]), do: true
  def keyword?([{k, _} | rest]) when is_atom(k), do: keyword?(rest)
  def keyword?(_), do: false

  defp check_arity(_where, arity, min, max, _more) when arity >= min and arity <= max, do: :ok

  defp check_arity(where, arity, min, max, more) do
    before = if more > 0, do: " before the function", else: ""
    bad("#{where}: takes #{min}..#{max} arguments#{before}, got #{arity}")
  end

  defp check_opts(where, opts) do
    cond do
      not keyword?(opts) ->
        bad("#{where}: the last argument must be a keyword list of options, got #{short(opts)}")

      (dups = Keyword.keys(opts) -- Enum.uniq(Keyword.keys(opts))) != [] ->
        bad("#{where}: option #{inspect(hd(dups))} given twice")

      true ->
        :ok
    end
  end

  defp named(where, spec, opts, optional_given) do
    {runtime, opts} = Keyword.pop(opts, :__runtime__, [])
    by_pos = MapSet.new(optional_given, &elem(&1, 0))
    params = Map.new(spec.params, fn {name, mode, type} -> {name, {mode, type}} end)

    Enum.reduce_while(opts, {:ok, %{}, runtime}, fn {key, value}, {:ok, acc, rt} ->
      case {params, spec[:var_keyword]} do
        {%{^key => {mode, type}}, _} ->
          cond do
            MapSet.member?(by_pos, key) ->
              {:halt, bad("#{where}: #{key} given both positionally and as an option")}

            mode in [:required, :required_keyword] ->
              {:halt, bad("#{where}: #{key} is required and goes positionally, not as an option")}

            mode == :positional_only ->
              {:halt, bad("#{where}: #{key} can only be given positionally")}

            not Type.check(type, value) ->
              {:halt, type_error(where, key, type, value)}

            true ->
              {:cont, {:ok, Map.put(acc, Atom.to_string(key), value), rt}}
          end

        {_, true} ->
          {:cont, {:ok, Map.put(acc, Atom.to_string(key), value), rt}}

        _ ->
          {:halt, unknown(where, spec, key)}
      end
    end)
  end

  defp unknown(where, spec, key) do
    known =
      for({name, mode, _} <- spec.params, mode in [:optional, :keyword], do: name) ++
        [:__runtime__]

    bad(
      "#{where}: unknown option #{inspect(key)}; known: #{Enum.map_join(known, ", ", &inspect/1)}"
    )
  end

  defp check_types(where, pairs) do
    Enum.find_value(pairs, :ok, fn {{name, _mode, type}, value} ->
      unless Type.check(type, value), do: type_error(where, name, type, value)
    end)
  end

  defp type_error(where, name, type, value),
    do: bad("#{where}: #{name} must be #{Type.spec(type)}, got #{short(value)}")

  defp short(value), do: inspect(value, limit: 8, printable_limit: 80)

  defp bad(message), do: {:error, Error.new(:bad_argument, message)}
end
