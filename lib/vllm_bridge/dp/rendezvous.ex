defmodule VllmBridge.DP.Rendezvous do
  @moduledoc """
  Where and how a pool's workers join a data-parallel (DP) group: the torch.distributed
  rendezvous of `vllm_bridge.dp.init_dp_group`, given from Elixir and checked here.

  A pool started with `dp: rendezvous` (`VllmBridge.Pool.Options`) makes worker `i` the
  DP rank `Enum.at(ranks, i)`: each worker gets the rendezvous in its environment
  (`VLLM_DP_RANK`, `VLLM_DP_SIZE`, `VLLM_DP_MASTER_IP`, `VLLM_DP_MASTER_PORT`, and
  `VLLM_DP_BACKEND` / `VLLM_DP_TIMEOUT_S` when given), so `Vllm.Dp.Module.init_dp_group/1`
  with no arguments joins the group, also after the worker restarts. Ranks of one group
  may sit in several pools, on several nodes or hosts: each pool names its own ranks.

      # node A (rank 0 hosts the rendezvous store)
      VllmBridge.start_pool(:dp, size: 1,
        dp: [master_addr: "10.0.0.1", master_port: 29_555, world_size: 2, ranks: [0]])

      # node B
      VllmBridge.start_pool(:dp, size: 1,
        dp: [master_addr: "10.0.0.1", master_port: 29_555, world_size: 2, ranks: [1]])

      # then, on every rank at once (one task per rank: the join waits for all of them)
      Vllm.Dp.Module.init_dp_group(__runtime__: [session_id: session.id])

  To join per call instead (a worker of a pool without `dp:`), `kwargs/2` gives the
  arguments of `Vllm.Dp.Module.init_dp_group` for one rank; per call, the worker accepts
  only a loopback `:master_addr` (`"127.0.0.1"`, `"::1"`, `"localhost"`: every rank on one
  host) or its own configured `VLLM_DP_MASTER_IP` (with its `VLLM_DP_MASTER_PORT`). A
  rendezvous on another host is the operator's to set, through `dp:` (docs/SECURITY.md).

  Fields:

    * `:master_addr` — the address of rank 0's host as **the other ranks** reach it (an IP
      address or a host name; not a wildcard such as `"0.0.0.0"`). Rank 0's rendezvous
      store listens on every interface of its host at `:master_port`; `"127.0.0.1"` works
      only when every rank runs on one host. The collectives themselves (gloo, NCCL) pick
      a network interface of their own; on hosts with several, name it with
      `GLOO_SOCKET_IFNAME` / `NCCL_SOCKET_IFNAME` in `worker_env` (docs/DEPLOYMENT.md).
    * `:master_port` — the rendezvous port, 1 to 65 535, free on rank 0's host and open
      to the other hosts through their firewalls.
    * `:world_size` — the number of DP ranks in the whole group (over every pool).
    * `:ranks` — the DP ranks of this pool's workers, by worker index: a list of distinct
      integers in `0..world_size - 1`, or a range. Its length must be the pool's `:size`.
    * `:backend` — `"gloo"`, `"nccl"` or `"cpu:gloo,cuda:nccl"`; `nil` (default) lets
      each worker choose by its device (the last when it has CUDA, else gloo).
    * `:timeout_s` — seconds a rank waits for its peers, at the join and at each
      collective (a rank that died or hangs fails the others' step after at most this
      long); `nil` (default) is the worker's default, 60.
  """

  alias VllmBridge.Error

  @enforce_keys [:master_addr, :master_port, :world_size, :ranks]
  defstruct [:master_addr, :master_port, :world_size, :ranks, backend: nil, timeout_s: nil]

  @typedoc "A checked rendezvous (`new/1`): `ranks` always a list."
  @type t :: %__MODULE__{
          master_addr: String.t(),
          master_port: 1..65_535,
          world_size: pos_integer(),
          ranks: [non_neg_integer()],
          backend: String.t() | nil,
          timeout_s: number() | nil
        }

  @prefix "dp rendezvous: "
  @backends ["gloo", "nccl", "cpu:gloo,cuda:nccl"]
  @keys [:master_addr, :master_port, :world_size, :ranks, :backend, :timeout_s]
  @wildcards ["0.0.0.0", "::", "[::]", "*"]
  @env_names ~w(VLLM_DP_RANK VLLM_DP_SIZE VLLM_DP_MASTER_IP VLLM_DP_MASTER_PORT
                VLLM_DP_BACKEND VLLM_DP_TIMEOUT_S)

  @doc """
  A checked rendezvous from a keyword list, a map or a `%VllmBridge.DP.Rendezvous{}`;
  `{:error, %VllmBridge.Error{type: :bad_argument}}` naming the first bad field and its
  value. An IP address tuple is accepted for `:master_addr`, a range for `:ranks`.
  """
  @spec new(t() | keyword() | map()) :: {:ok, t()} | {:error, Error.t()}
  def new(%__MODULE__{} = r), do: r |> Map.from_struct() |> new()

  def new(fields) when is_list(fields) or is_map(fields) do
    with {:ok, fields} <- fields_of(fields),
         {:ok, addr} <- master_addr(fields[:master_addr]),
         :ok <- check(:master_port, fields[:master_port], &port?/1, "an integer from 1 to 65535"),
         :ok <- check(:world_size, fields[:world_size], &pos_int?/1, "a positive integer"),
         {:ok, ranks} <- ranks(fields[:ranks], fields[:world_size]),
         :ok <-
           check(:backend, fields[:backend], &backend?/1, "nil or one of #{inspect(@backends)}"),
         :ok <-
           check(
             :timeout_s,
             fields[:timeout_s],
             &timeout?/1,
             "nil or a positive number of seconds"
           ) do
      {:ok,
       %__MODULE__{
         master_addr: addr,
         master_port: fields[:master_port],
         world_size: fields[:world_size],
         ranks: ranks,
         backend: fields[:backend],
         timeout_s: fields[:timeout_s]
       }}
    end
  end

  def new(other),
    do:
      bad(
        "must be a keyword list, a map or a %VllmBridge.DP.Rendezvous{}, got #{inspect(other, limit: 8)}"
      )

  @doc "The DP rank of the pool's worker `index`."
  @spec rank(t(), non_neg_integer()) :: non_neg_integer()
  def rank(%__MODULE__{ranks: ranks}, index), do: Enum.fetch!(ranks, index)

  @doc """
  The environment that makes the pool's worker `index` DP rank `rank(r, index)`:
  `[{name, value}]` of the `VLLM_DP_*` variables `vllm_bridge.dp` reads.
  """
  @spec env(t(), non_neg_integer()) :: [{String.t(), String.t()}]
  def env(%__MODULE__{} = r, index) do
    [
      {"VLLM_DP_RANK", rank(r, index)},
      {"VLLM_DP_SIZE", r.world_size},
      {"VLLM_DP_MASTER_IP", r.master_addr},
      {"VLLM_DP_MASTER_PORT", r.master_port},
      {"VLLM_DP_BACKEND", r.backend},
      {"VLLM_DP_TIMEOUT_S", r.timeout_s}
    ]
    |> Enum.reject(fn {_, v} -> v == nil end)
    |> Enum.map(fn {k, v} -> {k, to_string(v)} end)
  end

  @doc "The environment variables `env/2` sets (a pool's `worker_env` may not set them too)."
  @spec env_names() :: [String.t()]
  def env_names, do: @env_names

  @doc """
  The arguments of `Vllm.Dp.Module.init_dp_group` that join worker `index`'s rank, by
  name (append `__runtime__:`): for joining per call rather than through a pool's `dp:`,
  on loopback (a worker refuses another `:master_addr` from a call unless its own
  environment configures it).
  """
  @spec kwargs(t(), non_neg_integer()) :: keyword()
  def kwargs(%__MODULE__{} = r, index) do
    [
      rank: rank(r, index),
      world_size: r.world_size,
      master_addr: r.master_addr,
      master_port: r.master_port,
      backend: r.backend,
      timeout_s: r.timeout_s && r.timeout_s * 1.0
    ]
  end

  @doc false
  # The pool option `dp:`: nil, or a rendezvous whose ranks match the pool's size.
  @spec for_pool(term(), pos_integer()) :: {:ok, t() | nil} | {:error, Error.t()}
  def for_pool(nil, _size), do: {:ok, nil}

  def for_pool(dp, size) do
    case new(dp) do
      {:ok, %{ranks: ranks}} when length(ranks) != size ->
        as_option(bad("ranks #{inspect(ranks)} must name one DP rank per worker (size: #{size})"))

      {:ok, r} ->
        {:ok, r}

      error ->
        as_option(error)
    end
  end

  defp as_option({:error, e}),
    do: {:error, %{e | message: String.replace_prefix(e.message, @prefix, "pool option dp: ")}}

  defp fields_of(fields) do
    fields = Map.new(fields)

    case Map.keys(fields) -- @keys do
      [] -> {:ok, fields}
      unknown -> bad("unknown field(s) #{inspect(unknown)}; known: #{inspect(@keys)}")
    end
  rescue
    ArgumentError -> bad("must be a keyword list, got #{inspect(fields, limit: 8)}")
  end

  defp master_addr(addr) when is_tuple(addr) do
    case :inet.ntoa(addr) do
      {:error, _} -> bad_field(:master_addr, addr, "an IP address or a host name")
      chars -> master_addr(List.to_string(chars))
    end
  end

  defp master_addr(addr) when is_binary(addr) do
    cond do
      addr == "" or addr =~ ~r/\s/ ->
        bad_field(:master_addr, addr, "an IP address or a host name")

      addr in @wildcards ->
        bad_field(
          :master_addr,
          addr,
          "the address the other ranks connect to (rank 0's host as they reach it), not a wildcard"
        )

      true ->
        {:ok, addr}
    end
  end

  defp master_addr(other), do: bad_field(:master_addr, other, "an IP address or a host name")

  defp ranks(%Range{step: 1} = range, world_size), do: ranks(Enum.to_list(range), world_size)

  defp ranks(ranks, world_size) when is_list(ranks) and ranks != [] do
    cond do
      not Enum.all?(ranks, &(is_integer(&1) and &1 >= 0)) ->
        bad_field(:ranks, ranks, "a list of non-negative integers")

      (dup = ranks -- Enum.uniq(ranks)) != [] ->
        bad("ranks #{inspect(ranks)} name rank #{hd(dup)} twice; each worker is its own rank")

      (over = Enum.find(ranks, &(&1 >= world_size))) != nil ->
        bad("ranks #{inspect(ranks)}: rank #{over} is not below world_size #{world_size}")

      true ->
        {:ok, ranks}
    end
  end

  defp ranks(other, _), do: bad_field(:ranks, other, "a non-empty list or range of DP ranks")

  defp check(field, value, ok?, expected) do
    if ok?.(value), do: :ok, else: bad_field(field, value, expected)
  end

  defp port?(p), do: is_integer(p) and p in 1..65_535
  defp pos_int?(n), do: is_integer(n) and n >= 1
  defp backend?(b), do: b == nil or b in @backends
  defp timeout?(t), do: t == nil or (is_number(t) and t > 0)

  defp bad_field(field, value, expected),
    do: bad("#{field} must be #{expected}, got #{inspect(value, limit: 8)}")

  defp bad(message), do: {:error, Error.new(:bad_argument, @prefix <> message)}
end
