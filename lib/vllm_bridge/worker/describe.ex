defmodule VllmBridge.Worker.Describe do
  @moduledoc false
  # Short descriptions of what a worker sent where the protocol wanted something else (a
  # log frame's fields, a hello's import_errors), for messages and logs: never the whole
  # value (a worker may send megabytes, or a term nested 64 deep, where a name belongs),
  # and never a crash on a type that cannot be put in a string.

  # Strings longer than this are cut in a message, binaries that are not text are only
  # measured, and a frame of more items than this is only counted.
  @text_bytes 1_000
  @shown_bytes 80
  @frame_items 8
  # Integers up to 64 bits are shown (a pid, a level); bigger ones only measured.
  @shown_int 0xFFFF_FFFF_FFFF_FFFF

  @doc """
  `s` when it is UTF-8 text (cut to #{@text_bytes} bytes, marked with "..."); else nil.
  """
  @spec text(term()) :: String.t() | nil
  def text(s) when is_binary(s) do
    cond do
      not String.valid?(s) -> nil
      byte_size(s) <= @text_bytes -> s
      true -> cut(binary_part(s, 0, @text_bytes)) <> "..."
    end
  end

  def text(_other), do: nil

  # A cut may end inside a character: only whole characters are kept.
  defp cut(part) do
    case :unicode.characters_to_binary(part) do
      whole when is_binary(whole) -> whole
      {_incomplete_or_error, whole, _rest} -> whole
    end
  end

  @doc """
  A decoded frame (`{:ok, term}` or `{:error, reason}` of `VllmBridge.Codec.decode/1`) in
  a few words: a short list item by item (`item/1`), anything else as one item.
  """
  @spec frame({:ok, term()} | {:error, term()}) :: String.t()
  def frame({:ok, items}) when is_list(items) do
    case count(items, 0) do
      n when is_integer(n) and n <= @frame_items ->
        "[" <> Enum.map_join(items, ", ", &item/1) <> "]"

      _ ->
        item(items)
    end
  end

  def frame({:ok, other}), do: item(other)
  def frame({:error, reason}), do: "undecodable (#{item(reason)})"

  @doc "One value a worker sent, in a few words: short strings and numbers as they are."
  @spec item(term()) :: String.t()
  def item(b) when is_binary(b) do
    if byte_size(b) <= @shown_bytes and String.valid?(b),
      do: inspect(b),
      else: "a binary of #{byte_size(b)} bytes"
  end

  def item(x) when is_integer(x) and abs(x) <= @shown_int, do: Integer.to_string(x)

  def item(x) when is_integer(x),
    do: "an integer of #{byte_size(:binary.encode_unsigned(abs(x)))} bytes"

  def item(x) when is_float(x) or is_atom(x), do: inspect(x)
  def item(%module{}), do: "a #{inspect(module)}"
  def item(m) when is_map(m), do: "a map of #{many(map_size(m), "entry", "entries")}"

  def item(l) when is_list(l) do
    case count(l, 0) do
      :improper -> "an improper list"
      n -> "a list of #{many(n, "item", "items")}"
    end
  end

  def item(t) when is_tuple(t), do: "a tuple of #{many(tuple_size(t), "item", "items")}"
  def item(_other), do: "a value of another type"

  defp many(1, one, _many), do: "1 #{one}"
  defp many(n, _one, many), do: "#{n} #{many}"

  defp count([], n), do: n
  defp count([_ | rest], n), do: count(rest, n + 1)
  defp count(_tail, _n), do: :improper
end
