defmodule VllmBridge.Call.Wire do
  @moduledoc false
  # The messages of docs/PROTOCOL.md as frames: building requests from pre-encoded parts,
  # reading just the kind and id of a worker frame (`peek/1`, what the worker process needs to
  # route it) and decoding a reply into a result (done by the caller).
  #
  # Values go through `VllmBridge.Codec.encode/1` and `decode/1` only. The pieces of
  # msgpack written by hand are a request's array header, its kind and its id here, and
  # its arguments' array and map headers in `VllmBridge.Call.Wire.Args`, so that the
  # parts of a request can be encoded at different times: the arguments in the caller
  # before anything is reserved, the id and the milliseconds left just before the frame
  # is sent. `peek/1` reads the first two elements of a frame by hand (an array header, a
  # str, an unsigned int) and nothing after them: the worker process never decodes a
  # frame (it is untrusted, and a decode there would read the frame's result slots).

  alias VllmBridge.{Codec, Error, Ref}
  alias VllmBridge.Call.Wire.{Args, Refused}
  alias VllmBridge.Codec.SlotExt

  # Request bodies up to this size are flattened into one binary.
  @flatten_max 64 * 1024
  # What a frame's 4-byte length can say.
  @max_body 0xFFFF_FFFF

  @typedoc "What `peek/1` finds: the message kind and its id (nil when none)."
  @type head ::
          {:ok | :error | :chunk | :end | :pong, non_neg_integer() | nil}
          | {:log, nil}
          | {:hello, nil}
          | {:unknown, nil}

  @typedoc "A call target: a module attribute path, or an attribute of a referenced object."
  @type target :: {String.t(), String.t()} | {Ref.t(), String.t() | nil}

  # -- requests ---------------------------------------------------------------------------

  @doc """
  One request frame: the 4-byte big-endian length, then the body: `kind`, `id`, then the
  already encoded `fields`: at most 13, so that with the kind and the id the body is a
  fixarray (15 elements, a one-byte header), which covers every message of the protocol.

  A frame of up to 64 KiB is one binary (one cheap copy, then a single refc binary moves
  between processes); a larger one stays iodata, `[<<length::32>> | body]`, so that a
  large tensor's data goes to the port as the binary it already is instead of being
  copied into a new one. `body_size/1` reads the length back without a walk. Raises
  `ArgumentError` for a body longer than the header can say (`frame_request/4` does not
  raise).
  """
  @spec request(String.t(), non_neg_integer(), [iodata()]) :: iodata()
  def request(kind, id, fields), do: request(kind, id, fields, IO.iodata_length(fields))

  @doc """
  `request/3` when the byte size of `fields` is known already (`VllmBridge.Call.Request`
  counts its encoded arguments once, before anything is reserved), so that they are not
  walked again.
  """
  @spec request(String.t(), non_neg_integer(), [iodata()], non_neg_integer()) :: iodata()
  def request(kind, id, fields, fields_size) do
    case frame_request(kind, id, fields, fields_size) do
      {:ok, frame, _size} ->
        frame

      {:too_large, size} ->
        raise ArgumentError,
              "a request body of #{size} bytes cannot be framed: a frame's 4-byte length " <>
                "says at most #{@max_body} bytes"
    end
  end

  @doc """
  `request/4` for a caller that must not raise: `{:ok, frame, body_size}`, or
  `{:too_large, body_size}`, with nothing framed, when the body is longer than a 4-byte
  length can say (#{@max_body} bytes): its length written there would lose its high bits
  and read as another, smaller one.
  """
  @spec frame_request(String.t(), non_neg_integer(), [iodata()], non_neg_integer()) ::
          {:ok, iodata(), non_neg_integer()} | {:too_large, non_neg_integer()}
  def frame_request(kind, id, fields, fields_size) when length(fields) <= 13 do
    # The fixarray header, the kind and the id as one binary: the kinds' encodings are
    # known (`kind_bytes/1`), the id is written by `uint/1`, each the bytes
    # `Codec.encode/1` gives for it (test/codec/wire_frame_test.exs checks both).
    head = <<0x92 + length(fields), kind_bytes(kind)::binary, uint(id)::binary>>
    size = byte_size(head) + fields_size

    cond do
      size > @max_body -> {:too_large, size}
      size > @flatten_max -> {:ok, [<<size::32>>, head | fields], size}
      true -> {:ok, IO.iodata_to_binary([<<size::32>>, head | fields]), size}
    end
  end

  @doc "The body length of a frame made by `request/3,4`, read from its header."
  @spec body_size(iodata()) :: non_neg_integer()
  def body_size(<<size::32, _::binary>>), do: size
  def body_size([<<size::32>> | _]), do: size

  @doc "The most bytes a frame's body can take: what its 4-byte length can say."
  @spec max_body_size() :: pos_integer()
  def max_body_size, do: @max_body

  @doc """
  The most bytes the body of a request of `kind` can take when its encoded fields take
  `fields_size` bytes: the id (and the timeout, when `timed:` true) counted at their largest
  encoding (9 bytes each), since neither is fixed until the request is sent.
  """
  @spec max_request_size(String.t(), non_neg_integer(), timed: boolean()) :: pos_integer()
  def max_request_size(kind, fields_size, timed: timed),
    do: 1 + byte_size(kind_bytes(kind)) + 9 + if(timed, do: 9, else: 0) + fields_size

  # The protocol's request kinds as msgpack strs (short ASCII: a fixstr each), so that a
  # frame's head is not run through the codec's UTF-8 check on every request.
  @kind_bytes Map.new(
                ~w(call get enter exit release stream ping cancel credit),
                &{&1, <<0xA0 + byte_size(&1), &1::binary>>}
              )

  @doc "`kind` as msgpack (a str): what `Codec.encode/1` gives, precomputed for the protocol's kinds."
  @spec kind_bytes(String.t()) :: binary()
  def kind_bytes(kind) do
    case @kind_bytes do
      %{^kind => bytes} -> bytes
      _ -> IO.iodata_to_binary(Codec.encode(kind))
    end
  end

  @doc """
  A non-negative integer as msgpack, the bytes `Codec.encode/1` gives (a request's id and
  milliseconds left), without the codec's dispatch; other integers go to the codec.
  """
  @spec uint(integer()) :: binary()
  def uint(i) when is_integer(i) and i >= 0 and i < 0x80, do: <<i>>
  def uint(i) when is_integer(i) and i >= 0 and i < 0x100, do: <<0xCC, i>>
  def uint(i) when is_integer(i) and i >= 0 and i < 0x10000, do: <<0xCD, i::16>>
  def uint(i) when is_integer(i) and i >= 0 and i < 0x100000000, do: <<0xCE, i::32>>
  def uint(i) when is_integer(i) and i >= 0 and i < 0x10000000000000000, do: <<0xCF, i::64>>
  def uint(i), do: IO.iodata_to_binary(Codec.encode(i))

  @doc """
  The `:bad_argument` of a request whose frame would be `size` bytes, over the frame
  limit `max` (`what` names the limit's origin).
  """
  @spec too_large(non_neg_integer(), pos_integer(), String.t()) :: Error.t()
  def too_large(size, max, what) do
    Error.new(
      :bad_argument,
      "the request's frame would be #{size} bytes, over the frame limit of #{max} bytes " <>
        "(#{what}); it was not sent"
    )
  end

  @doc "Encodes one value of a request (raises `ArgumentError` naming what cannot travel)."
  @spec value(term()) :: iodata()
  def value(term), do: Codec.encode(term)

  @doc """
  Encodes the target, args and kwargs of a `call`/`stream`/`enter` (or only the target
  for `get`): `{:ok, iodata}` or a `:bad_argument` error naming the argument
  (`args[1]`, `kwargs["x"]`) and the value that cannot travel. Runs in the caller's
  process, before anything is reserved or sent.

  Each argument is encoded on its own, so each may nest `VllmBridge.Codec.max_depth/0`
  levels, and each is refused here when Python could not take it as it is: a map key
  Python cannot hash, map keys Python holds equal, nesting past that depth (see
  `VllmBridge.Codec`). A keyword given twice (`[a: 1, a: 2]`, or `:a` and `"a"`) is
  refused, not overwritten.
  """
  @spec encode_invoke(term(), list() | nil, map() | keyword() | nil) ::
          {:ok, [iodata()]} | {:error, Error.t()}
  def encode_invoke(target, args, kwargs) do
    with {:ok, t} <- target(target),
         {:ok, parts} <- Args.encode(args, kwargs) do
      {:ok, [Codec.encode(t) | parts]}
    end
  rescue
    e in ArgumentError -> {:error, Error.new(:bad_argument, Exception.message(e))}
  end

  @doc """
  `encode_invoke/3` for a generated binding's target (`VllmBridge.Bindings`): a
  `{module, path}` of strings fixed when the binding was compiled, so there are as many as
  there are bindings. Its encoding is built once, on first use, and kept in
  `:persistent_term`; a call then encodes only its arguments (a call with none, only
  their two headers). The bytes are `encode_invoke/3`'s (test/codec/wire_frame_test.exs).
  """
  @spec encode_invoke_binding({String.t(), String.t()}, list(), map() | keyword()) ::
          {:ok, [iodata()]} | {:error, Error.t()}
  def encode_invoke_binding({module, path} = target, args, kwargs)
      when is_binary(module) and is_binary(path) do
    encoded = Args.binding_target(module, path)

    case {args, kwargs} do
      {[], empty} when empty == %{} or empty == [] ->
        {:ok, [encoded, 0x90, <<0x80>>]}

      _ ->
        with {:ok, [_ | parts]} <- encode_invoke(target, args, kwargs),
             do: {:ok, [encoded | parts]}
    end
  end

  def encode_invoke_binding(target, args, kwargs), do: encode_invoke(target, args, kwargs)

  @doc "The wire form of a target (`[\"m\", module, path]` or `[\"r\", ref, path]`)."
  @spec target(term()) :: {:ok, list()} | {:error, Error.t()}
  def target({module, path}) when is_binary(module) and is_binary(path),
    do: {:ok, ["m", module, path]}

  def target({%Ref{} = ref, path}) when is_binary(path) or is_nil(path),
    do: {:ok, ["r", ref, path]}

  def target(other) do
    bad(
      "a target must be {\"module\", \"path\"} or {%VllmBridge.Ref{}, \"path\" | nil}, got " <>
        inspect(other, limit: 5)
    )
  end

  # -- replies ----------------------------------------------------------------------------

  @doc """
  The kind and id of a frame from the worker, reading only its first bytes: the common
  heads by pattern here, any other array and str form by `peek_general/1`. Nothing after
  the id is read; a head that cannot be read is `{:unknown, nil}`.
  """
  @spec peek(binary()) :: head()
  def peek(<<0x93, 0xA2, "ok", rest::binary>>), do: {:ok, id(rest)}
  def peek(<<0x93, 0xA5, "error", rest::binary>>), do: {:error, id(rest)}
  def peek(<<0x93, 0xA5, "chunk", rest::binary>>), do: {:chunk, id(rest)}
  def peek(<<0x92, 0xA3, "end", rest::binary>>), do: {:end, id(rest)}
  def peek(<<0x93, 0xA4, "pong", rest::binary>>), do: {:pong, id(rest)}
  def peek(<<0x94, 0xA3, "log", _::binary>>), do: {:log, nil}
  def peek(<<0x92, 0xA5, "hello", _::binary>>), do: {:hello, nil}
  def peek(other), do: peek_general(other)

  defp id(<<0::1, n::7, _::binary>>), do: n
  defp id(<<0xCC, n::8, _::binary>>), do: n
  defp id(<<0xCD, n::16, _::binary>>), do: n
  defp id(<<0xCE, n::32, _::binary>>), do: n
  defp id(<<0xCF, n::64, _::binary>>), do: n
  defp id(_), do: nil

  @kinds %{
    "ok" => :ok,
    "error" => :error,
    "chunk" => :chunk,
    "end" => :end,
    "pong" => :pong,
    "log" => :log,
    "hello" => :hello
  }

  @doc """
  `peek/1`'s general path: the kind and id read by hand from a head of any form (a
  fixarray, array 16 or array 32; the kind a fixstr or str 8, 16 or 32; the id an
  unsigned int, else nil), without reading further and without decoding the frame: it
  runs in the worker process for every frame, which must neither spend a full decode
  on an untrusted frame nor read (and hand back) the result slots the frame names
  before its caller does. It answers as a full decode would for every well-formed frame
  (test/codec/peek_property_test.exs); a frame whose head is well formed and whose tail
  is not is read by its head (its caller's decode then refuses it).
  """
  @spec peek_general(binary()) :: head()
  def peek_general(bin) do
    with {n, rest} when n > 0 <- array_head(bin),
         {kind, rest} <- str_head(rest),
         {:ok, tag} <- Map.fetch(@kinds, kind) do
      if tag in [:log, :hello] or n == 1, do: {tag, nil}, else: {tag, id(rest)}
    else
      _ -> {:unknown, nil}
    end
  end

  defp array_head(<<0b1001::4, n::4, rest::binary>>), do: {n, rest}
  defp array_head(<<0xDC, n::16, rest::binary>>), do: {n, rest}
  defp array_head(<<0xDD, n::32, rest::binary>>), do: {n, rest}
  defp array_head(_), do: :error

  defp str_head(<<0b101::3, n::5, s::binary-size(n), rest::binary>>), do: {s, rest}
  defp str_head(<<0xD9, n::8, s::binary-size(n), rest::binary>>), do: {s, rest}
  defp str_head(<<0xDA, n::16, s::binary-size(n), rest::binary>>), do: {s, rest}
  defp str_head(<<0xDB, n::32, s::binary-size(n), rest::binary>>), do: {s, rest}
  defp str_head(_), do: :error

  @doc """
  Decodes an `ok` or `error` reply (the caller does this, not the worker process):
  `{:ok, value}` or `{:error, %VllmBridge.Error{}}`. `origin` is the frame limit of the
  worker the reply came from and its Python process's OS pid (they come with the reply,
  VllmBridge.Worker.Messages; nil: unknown, the default limit): the limit bounds the
  reply's result slots, and only that process's result slots are accepted, any other
  refused unread (`VllmBridge.Codec.SlotExt.within_reply/3`; nil: none). `from` is the worker process the reply
  came from (nil: unknown): the references of a reply refused are released to it
  (`decode_reply_general/3`).
  """
  @spec decode_reply(binary(), SlotExt.origin() | nil, pid() | nil) ::
          {:ok, term()} | {:error, Error.t()}
  def decode_reply(bin, origin \\ nil, from \\ nil)

  # Fast path: an `ok` whose id is an unsigned int and whose value is a scalar spanning
  # the rest of the frame (the reply of most small calls), read by pattern; any other
  # shape goes to `decode_reply_general/3`, which answers the same for these
  # (test/codec/reply_fast_path_test.exs).
  def decode_reply(<<0x93, 0xA2, "ok", rest::binary>> = bin, origin, from) do
    case scalar(after_uint(rest)) do
      {:ok, _} = ok -> ok
      :general -> decode_reply_general(bin, origin, from)
    end
  end

  def decode_reply(bin, origin, from), do: decode_reply_general(bin, origin, from)

  defp after_uint(<<0::1, _::7, r::binary>>), do: r
  defp after_uint(<<0xCC, _::8, r::binary>>), do: r
  defp after_uint(<<0xCD, _::16, r::binary>>), do: r
  defp after_uint(<<0xCE, _::32, r::binary>>), do: r
  defp after_uint(<<0xCF, _::64, r::binary>>), do: r
  defp after_uint(_), do: nil

  defp scalar(<<0xC3>>), do: {:ok, true}
  defp scalar(<<0xC2>>), do: {:ok, false}
  defp scalar(<<0xC0>>), do: {:ok, nil}
  defp scalar(<<0::1, i::7>>), do: {:ok, i}
  defp scalar(<<0b111::3, _::5>> = b), do: {:ok, :binary.decode_unsigned(b) - 256}
  defp scalar(<<0xCC, i::8>>), do: {:ok, i}
  defp scalar(<<0xCD, i::16>>), do: {:ok, i}
  defp scalar(<<0xCE, i::32>>), do: {:ok, i}
  defp scalar(<<0xCF, i::64>>), do: {:ok, i}
  defp scalar(<<0xD0, i::signed-8>>), do: {:ok, i}
  defp scalar(<<0xD1, i::signed-16>>), do: {:ok, i}
  defp scalar(<<0xD2, i::signed-32>>), do: {:ok, i}
  defp scalar(<<0xD3, i::signed-64>>), do: {:ok, i}
  # (NaN and the infinities do not match `float-64`: they take the general path.)
  defp scalar(<<0xCB, f::float-64>>), do: {:ok, f}
  defp scalar(<<0b101::3, n::5, s::binary-size(n)>>), do: {:ok, s}
  defp scalar(<<0xD9, n::8, s::binary-size(n)>>), do: {:ok, s}
  defp scalar(_), do: :general

  @doc """
  `decode_reply/3`'s general path: a full decode of any reply. A reply it refuses
  (undecodable, of another shape, or an error without its error map) hands back the
  result slots of its worker it names and releases the references it carries to `from`
  (`VllmBridge.Call.Wire.Refused`).
  """
  @spec decode_reply_general(binary(), SlotExt.origin() | nil, pid() | nil) ::
          {:ok, term()} | {:error, Error.t()}
  def decode_reply_general(bin, origin \\ nil, from \\ nil) do
    case SlotExt.within_reply(origin, byte_size(bin), fn -> Codec.decode(bin) end) do
      {:ok, [kind, _id, value]} when kind in ["ok", "chunk", "pong"] ->
        {:ok, value}

      {:ok, ["error", _id, %{"type" => type} = map]} when is_binary(type) ->
        {:error, Error.from_wire(map)}

      # (An error map without its type is refused too: `Error.from_wire/1` names it.)
      {:ok, ["error", _id, malformed]} ->
        Refused.settle(bin, origin, from)
        {:error, Error.from_wire(malformed)}

      {:ok, other} ->
        Refused.settle(bin, origin, from)

        {:error,
         Error.new(
           :protocol,
           "unexpected reply #{inspect(other, limit: 8, printable_limit: 200)}"
         )}

      {:error, reason} ->
        Refused.settle(bin, origin, from)
        {:error, Error.new(:protocol, "undecodable reply: #{reason}")}
    end
  end

  defp bad(message), do: {:error, Error.new(:bad_argument, message)}
end
