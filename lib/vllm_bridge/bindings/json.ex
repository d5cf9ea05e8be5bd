defmodule VllmBridge.Bindings.Json do
  @moduledoc false
  # A small JSON encoder and decoder for the binding manifests (`priv/bindings/*.json`).
  #
  # Encoding is deterministic and meant for reading and diffing: object keys sorted, two
  # spaces of indentation, one member or element per line, empty containers as `{}` / `[]`,
  # non-ASCII characters written as they are (UTF-8), a final newline. It takes `nil`,
  # booleans, integers, floats, strings (valid UTF-8), lists, and maps with string keys;
  # anything else raises `ArgumentError` naming it.
  #
  # Decoding takes standard JSON (RFC 8259): objects become maps with string keys, numbers
  # with a fraction or an exponent become floats, others integers. It returns
  # `{:error, message}` naming the byte offset of the first problem.

  @typedoc "A JSON value as Elixir holds it."
  @type value :: nil | boolean() | number() | String.t() | [value()] | %{String.t() => value()}

  # -- encoding ---------------------------------------------------------------------------

  @doc "The pretty, deterministic JSON text of `value` (see the moduledoc)."
  @spec encode!(value()) :: String.t()
  def encode!(value), do: IO.iodata_to_binary([enc(value, 0), ?\n])

  defp enc(nil, _), do: "null"
  defp enc(true, _), do: "true"
  defp enc(false, _), do: "false"
  defp enc(n, _) when is_integer(n), do: Integer.to_string(n)
  defp enc(f, _) when is_float(f), do: :erlang.float_to_binary(f, [:short])
  defp enc(s, _) when is_binary(s), do: string(s)
  defp enc([], _), do: "[]"

  defp enc(list, depth) when is_list(list) do
    inner = indent(depth + 1)
    items = Enum.map(list, &[inner, enc(&1, depth + 1)])
    ["[\n", Enum.intersperse(items, ",\n"), ?\n, indent(depth), ?]]
  end

  defp enc(map, _) when map == %{}, do: "{}"

  defp enc(map, depth) when is_map(map) and not is_struct(map) do
    inner = indent(depth + 1)

    members =
      map
      |> Enum.map(fn
        {k, v} when is_binary(k) -> {k, v}
        {k, _} -> raise ArgumentError, "JSON object keys must be strings, got #{inspect(k)}"
      end)
      |> Enum.sort_by(&elem(&1, 0))
      |> Enum.map(fn {k, v} -> [inner, string(k), ": ", enc(v, depth + 1)] end)

    ["{\n", Enum.intersperse(members, ",\n"), ?\n, indent(depth), ?}]
  end

  defp enc(other, _), do: raise(ArgumentError, "cannot encode #{inspect(other)} as JSON")

  defp indent(depth), do: String.duplicate("  ", depth)

  defp string(s) do
    unless String.valid?(s), do: raise(ArgumentError, "not valid UTF-8: #{inspect(s)}")
    [?", escape(s, ""), ?"]
  end

  defp escape(<<>>, acc), do: acc
  defp escape(<<?", rest::binary>>, acc), do: escape(rest, acc <> "\\\"")
  defp escape(<<?\\, rest::binary>>, acc), do: escape(rest, acc <> "\\\\")
  defp escape(<<?\n, rest::binary>>, acc), do: escape(rest, acc <> "\\n")
  defp escape(<<?\r, rest::binary>>, acc), do: escape(rest, acc <> "\\r")
  defp escape(<<?\t, rest::binary>>, acc), do: escape(rest, acc <> "\\t")

  defp escape(<<c, rest::binary>>, acc) when c < 0x20,
    do: escape(rest, acc <> "\\u" <> String.pad_leading(Integer.to_string(c, 16), 4, "0"))

  defp escape(<<c::utf8, rest::binary>>, acc), do: escape(rest, acc <> <<c::utf8>>)

  # -- decoding ---------------------------------------------------------------------------

  @doc "Decodes JSON text: `{:ok, value}` or `{:error, message}`."
  @spec decode(binary()) :: {:ok, value()} | {:error, String.t()}
  def decode(text) when is_binary(text) do
    {value, rest} = text |> ws() |> value(text)

    case ws(rest) do
      "" -> {:ok, value}
      more -> fail(text, more, "unexpected text after the value")
    end
  catch
    {:json_error, message} -> {:error, message}
  end

  @doc "Like `decode/1`, raising `ArgumentError` on bad JSON."
  @spec decode!(binary()) :: value()
  def decode!(text) do
    case decode(text) do
      {:ok, value} -> value
      {:error, message} -> raise ArgumentError, message
    end
  end

  defp ws(<<c, rest::binary>>) when c in [?\s, ?\t, ?\n, ?\r], do: ws(rest)
  defp ws(rest), do: rest

  defp value(<<"null", r::binary>>, _), do: {nil, r}
  defp value(<<"true", r::binary>>, _), do: {true, r}
  defp value(<<"false", r::binary>>, _), do: {false, r}
  defp value(<<?", r::binary>>, all), do: str(r, all, [])
  defp value(<<?[, r::binary>>, all), do: array(ws(r), all, [])
  defp value(<<?{, r::binary>>, all), do: object(ws(r), all, %{})
  defp value(<<c, _::binary>> = r, all) when c == ?- or c in ?0..?9, do: number(r, all)
  defp value(r, all), do: fail(all, r, "expected a JSON value")

  defp array(<<?], r::binary>>, _all, []), do: {[], r}

  defp array(r, all, acc) do
    {v, r} = value(r, all)

    case ws(r) do
      <<?,, r::binary>> -> array(ws(r), all, [v | acc])
      <<?], r::binary>> -> {Enum.reverse([v | acc]), r}
      r -> fail(all, r, "expected ',' or ']' in an array")
    end
  end

  defp object(<<?}, r::binary>>, _all, acc) when acc == %{}, do: {acc, r}

  defp object(<<?", r::binary>>, all, acc) do
    {k, r} = str(r, all, [])

    {v, r} =
      case ws(r) do
        <<?:, r::binary>> -> value(ws(r), all)
        r -> fail(all, r, "expected ':' after an object key")
      end

    if Map.has_key?(acc, k), do: fail(all, r, "duplicate object key #{inspect(k)}")
    acc = Map.put(acc, k, v)

    case ws(r) do
      <<?,, r::binary>> -> object(ws(r), all, acc)
      <<?}, r::binary>> -> {acc, r}
      r -> fail(all, r, "expected ',' or '}' in an object")
    end
  end

  defp object(r, all, _acc), do: fail(all, r, "expected a string key in an object")

  defp str(<<?", r::binary>>, _all, acc), do: {IO.iodata_to_binary(Enum.reverse(acc)), r}

  defp str(<<?\\, c, r::binary>>, all, acc) when c in ~c'"\\/bfnrt' do
    ch = %{?" => ?", ?\\ => ?\\, ?/ => ?/, ?b => ?\b, ?f => ?\f, ?n => ?\n, ?r => ?\r, ?t => ?\t}
    str(r, all, [Map.fetch!(ch, c) | acc])
  end

  defp str(<<?\\, ?u, hex::binary-4, r::binary>> = at, all, acc) do
    case hex4(hex) do
      hi when hi in 0xD800..0xDBFF ->
        with <<?\\, ?u, hex2::binary-4, r2::binary>> <- r,
             lo when lo in 0xDC00..0xDFFF <- hex4(hex2) do
          cp = 0x10000 + Bitwise.bsl(hi - 0xD800, 10) + (lo - 0xDC00)
          str(r2, all, [<<cp::utf8>> | acc])
        else
          _ -> fail(all, at, "unpaired UTF-16 surrogate escape")
        end

      lo when lo in 0xDC00..0xDFFF ->
        fail(all, at, "unpaired UTF-16 surrogate escape")

      cp when is_integer(cp) ->
        str(r, all, [<<cp::utf8>> | acc])

      nil ->
        fail(all, at, "bad \\u escape")
    end
  end

  defp str(<<?\\, _::binary>> = r, all, _acc), do: fail(all, r, "bad escape in a string")

  defp str(<<c, _::binary>> = r, all, _acc) when c < 0x20,
    do: fail(all, r, "control character in a string")

  defp str(<<c::utf8, r::binary>>, all, acc), do: str(r, all, [<<c::utf8>> | acc])
  defp str(r, all, _acc), do: fail(all, r, "unterminated string or invalid UTF-8")

  defp hex4(hex) do
    case Integer.parse(hex, 16) do
      {n, ""} -> n
      _ -> nil
    end
  end

  @number ~r/\A-?(?:0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?/

  defp number(r, all) do
    case Regex.run(@number, r, capture: :all) do
      [text | parts] ->
        rest = binary_part(r, byte_size(text), byte_size(r) - byte_size(text))

        if Enum.any?(parts, &(&1 != "")),
          do: {float(text, parts), rest},
          else: {String.to_integer(text), rest}

      nil ->
        fail(all, r, "bad number")
    end
  end

  # Erlang's float parser needs a fraction: "1e5" -> "1.0e5".
  defp float(text, [frac | _]) do
    normal = if frac == "", do: String.replace(text, ~r/[eE]/, ".0e", global: false), else: text
    String.to_float(normal)
  end

  defp fail(all, rest, message),
    do: throw({:json_error, "JSON: #{message} at byte #{byte_size(all) - byte_size(rest)}"})
end
