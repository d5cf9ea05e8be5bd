defmodule VllmBridge.Worker.OutputLines do
  @moduledoc false
  # The lines of a worker's stdout or stderr (VllmBridge.Worker.Output reads them), cut
  # and logged: a line is cut at @max_line bytes (the rest of it up to its newline is
  # dropped, and the line says so); "\r" ends a line as "\n" does (progress bars), and
  # empty lines are dropped; invalid UTF-8 becomes U+FFFD. A stream is a map with its
  # `name` (:stdout, logged at :info, or :stderr, at :warning), the partial last line
  # (`buf`) and whether the rest of a line already cut is being dropped (`skip`).

  require Logger

  @max_line 16_384

  @doc "The longest line logged as it is (bytes); a longer one is cut."
  @spec max_line() :: pos_integer()
  def max_line, do: @max_line

  @doc false
  # Cuts `data` into lines after what `stream` held: every whole line is logged, the rest
  # is kept (at most @max_line bytes). Public for the tests of the cutting.
  @spec feed(map(), binary(), keyword()) :: map()
  def feed(stream, data, meta) do
    {lines, rest} = split(stream.buf <> data)
    skip = Enum.reduce(lines, stream.skip, fn line, skip -> line(stream, line, skip, meta) end)

    cond do
      skip ->
        # Still inside a line already cut: its rest is dropped up to its newline.
        %{stream | buf: "", skip: true}

      byte_size(rest) > @max_line ->
        emit(stream, cut(rest), meta)
        %{stream | buf: "", skip: true}

      true ->
        %{stream | buf: rest, skip: false}
    end
  end

  # A whole line: logged (unless it ends a line already cut); afterwards, no line is cut.
  defp line(_stream, _line, true, _meta), do: false

  defp line(stream, line, false, meta) do
    if byte_size(line) > @max_line,
      do: emit(stream, cut(line), meta),
      else: emit(stream, line, meta)

    false
  end

  defp cut(line) do
    binary_part(line, 0, @max_line) <> " [line cut at #{@max_line} bytes]"
  end

  defp split(bin) do
    case :binary.split(bin, ["\r\n", "\n", "\r"], [:global]) do
      [rest] -> {[], rest}
      parts -> {Enum.drop(parts, -1), List.last(parts)}
    end
  end

  @doc false
  # The partial last line of `stream`, logged (its stream ended).
  @spec flush(map(), keyword()) :: :ok
  def flush(%{buf: ""}, _meta), do: :ok
  def flush(stream, meta), do: emit(stream, stream.buf, meta)

  defp emit(_stream, "", _meta), do: :ok

  defp emit(stream, line, meta) do
    level = if stream.name == :stdout, do: :info, else: :warning
    text = scrub(line)

    Logger.log(level, fn -> "[python #{stream.name}] #{text}" end, [
      {:python_stream, stream.name} | meta
    ])
  end

  # Logger wants UTF-8: an invalid byte becomes U+FFFD.
  defp scrub(bin) do
    case :unicode.characters_to_binary(bin) do
      good when is_binary(good) ->
        good

      {_, good, <<_bad, rest::binary>>} ->
        good <> "\uFFFD" <> scrub(rest)

      {_, good, _} ->
        good
    end
  end
end
