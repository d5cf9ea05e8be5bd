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
  def split(spec, args, more \\ 0)

  # A function without parameters (most of the bindings' attribute readers and queries)
  # called with no options, or with only runtime options: nothing to check. Every other
  # call, errors included, takes the general path, which answers the same for these
  # (test/bindings/args_test.exs).
  def split(%{params: []}, [], _more), do: {:ok, [], %{}, []}
  def split(%{params: []}, [[]], _more), do: {:ok, [], %{}, []}
  def split(%{params: []}, [[__runtime__: runtime]], _more), do: {:ok, [], %{}, runtime}
  def split(spec, args, more), do: split_general(spec, args, more)

  @doc "`split/3`'s general path (any spec, any arguments)."
  @spec split_general(spec(), list(), non_neg_integer()) ::
          {:ok, list(), %{String.t() => term()}, keyword()} | {:error, Error.t()}
  def split_general(spec, args, more) do
    {fixed, positional} = partition(spec.params, [], [])
    n = length(fixed)
    m = length(positional)
    arity = length(args)

    {given, opts} =
      cond do
        arity == n -> {args, []}
        arity == n + m + 1 -> split_last(args)
        arity > n and arity <= n + m and keyword?(List.last(args)) -> split_last(args)
        true -> {args, []}
      end

    # The function's name and arity: formatted into a message only when there is an error.
    where = {spec.name, arity + more}
    {fixed_values, optional_values} = Enum.split(given, n)
    optional_given = Enum.take(positional, length(optional_values))

    with :ok <- check_arity(where, arity, n, n + m + 1, more),
         :ok <- check_opts(where, opts),
         {:ok, by_name, runtime} <- named(where, spec, opts, optional_given),
         :ok <- check_types(where, fixed, fixed_values),
         :ok <- check_types(where, optional_given, optional_values) do
      {py_args, kwargs} = place(fixed, fixed_values, [], by_name)
      {:ok, py_args ++ optional_values, kwargs, runtime}
    end
  end

  # {required parameters (positional in Elixir), optional positional ones}, in order;
  # `:keyword` parameters are given by name only.
  defp partition([], fixed, positional), do: {Enum.reverse(fixed), Enum.reverse(positional)}

  defp partition([{_, mode, _} = p | rest], fixed, positional)
       when mode in [:required, :required_keyword],
       do: partition(rest, [p | fixed], positional)

  defp partition([{_, mode, _} = p | rest], fixed, positional)
       when mode in [:optional, :positional_only],
       do: partition(rest, fixed, [p | positional])

  defp partition([_ | rest], fixed, positional), do: partition(rest, fixed, positional)

  defp split_last(args), do: {Enum.drop(args, -1), List.last(args)}

  # The required values: positional ones in order, keyword-only ones by name.
  defp place([], [], acc, kwargs), do: {Enum.reverse(acc), kwargs}

  defp place([{_, :required, _} | params], [v | values], acc, kwargs),
    do: place(params, values, [v | acc], kwargs)

  defp place([{name, :required_keyword, _} | params], [v | values], acc, kwargs),
    do: place(params, values, acc, Map.put(kwargs, Atom.to_string(name), v))

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
    bad(where, "takes #{min}..#{max} arguments#{before}, got #{arity}")
  end

  defp check_opts(_where, []), do: :ok
  defp check_opts(_where, [{key, _}]) when is_atom(key), do: :ok

  defp check_opts(where, opts) do
    cond do
      not keyword?(opts) ->
        bad(where, "the last argument must be a keyword list of options, got #{short(opts)}")

      (dups = Keyword.keys(opts) -- Enum.uniq(Keyword.keys(opts))) != [] ->
        bad(where, "option #{inspect(hd(dups))} given twice")

      true ->
        :ok
    end
  end

  defp named(_where, _spec, [], _optional_given), do: {:ok, %{}, []}
  defp named(_where, _spec, [__runtime__: rt], _optional_given), do: {:ok, %{}, rt}

  defp named(where, spec, opts, optional_given) do
    {runtime, opts} = Keyword.pop(opts, :__runtime__, [])
    by_pos = MapSet.new(optional_given, &elem(&1, 0))
    params = Map.new(spec.params, fn {name, mode, type} -> {name, {mode, type}} end)

    Enum.reduce_while(opts, {:ok, %{}, runtime}, fn {key, value}, {:ok, acc, rt} ->
      case {params, spec[:var_keyword]} do
        {%{^key => {mode, type}}, _} ->
          cond do
            MapSet.member?(by_pos, key) ->
              {:halt, bad(where, "#{key} given both positionally and as an option")}

            mode in [:required, :required_keyword] ->
              {:halt, bad(where, "#{key} is required and goes positionally, not as an option")}

            mode == :positional_only ->
              {:halt, bad(where, "#{key} can only be given positionally")}

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
      where,
      "unknown option #{inspect(key)}; known: #{Enum.map_join(known, ", ", &inspect/1)}"
    )
  end

  defp check_types(_where, [], _values), do: :ok

  defp check_types(where, [{name, _mode, type} | params], [value | values]) do
    if Type.check(type, value),
      do: check_types(where, params, values),
      else: type_error(where, name, type, value)
  end

  defp type_error(where, name, type, value),
    do: bad(where, "#{name} must be #{Type.spec(type)}, got #{short(value)}")

  defp short(value), do: inspect(value, limit: 8, printable_limit: 80)

  defp bad({name, arity}, message),
    do: {:error, Error.new(:bad_argument, "#{name}/#{arity}: #{message}")}
end
