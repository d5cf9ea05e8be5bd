defmodule VllmBridge.Call.Release do
  @moduledoc false
  # `VllmBridge.release/2` (whose doc says what it does): the references grouped by the
  # worker instance and session that hold them, one `release` request per group, and each
  # group's references forgotten by their owner once released. Apart from the facade, as
  # `VllmBridge.Call.All` is, so that VllmBridge holds the API and its docs.

  alias VllmBridge.{Error, Ref}
  alias VllmBridge.Call.{Run, Runtime, Wire}
  alias VllmBridge.Session.LooseRefs

  @doc "See `VllmBridge.release/2`."
  @spec run(term(), VllmBridge.Runtime.opts()) :: {:ok, non_neg_integer()} | {:error, Error.t()}
  def run(%Ref{} = ref, opts), do: run([ref], opts)

  def run(refs, opts) when is_list(refs) do
    with {:ok, rt} <- Runtime.resolve(opts),
         :ok <- all_refs(refs),
         do: release(rt, refs, 1)
  end

  def run(other, _opts),
    do:
      {:error,
       Error.new(
         :bad_argument,
         "release needs a Ref or a list of them, got #{inspect(other, limit: 5)}"
       )}

  @doc false
  # Releases the references in `value`, a value nobody will hold (an answer off the
  # protocol), in their sessions, each to the worker holding it. What such a release is
  # answered is not followed further: a worker that answers it off the protocol as well
  # gets no more requests for it.
  @spec drop(Runtime.t(), term()) :: :ok
  def drop(rt, value) do
    case Ref.collect(value) do
      [] -> :ok
      refs -> _ = release(rt, refs, 0)
    end

    :ok
  end

  # `depth`: how many answers off the protocol are still followed (their references
  # released in turn).
  defp release(rt, refs, depth) do
    refs
    |> Ref.release_groups()
    |> Enum.reduce_while({:ok, 0}, fn {_instance_and_session, group}, {:ok, n} ->
      # Named by how many it releases: the list itself would be copied into the
      # request's message and kept in the worker's table while it is in flight.
      what = "of #{length(group)} reference(s)"

      case Run.run(rt, "release", [Wire.value(group)], what: what, bound: hd(group), timed: false) do
        {:ok, k} when is_integer(k) ->
          LooseRefs.forget(group)
          {:cont, {:ok, n + k}}

        {:ok, other} ->
          if depth > 0, do: release(rt, Ref.collect(other), depth - 1)
          {:halt, {:error, Error.new(:protocol, "release answered #{inspect(other, limit: 5)}")}}

        {:error, e} ->
          {:halt, {:error, e}}
      end
    end)
  end

  defp all_refs(refs) do
    case Enum.reject(refs, &match?(%Ref{}, &1)) do
      [] ->
        :ok

      [bad | _] ->
        {:error, Error.new(:bad_argument, "release: not a reference: #{inspect(bad, limit: 5)}")}
    end
  end
end
