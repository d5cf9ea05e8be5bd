defmodule VllmBridge.Worker.Intake do
  @moduledoc false
  # How requests reach the port (VllmBridge.Worker, phase :ready): each is admitted into
  # the table of calls (VllmBridge.Worker.Calls) or refused, and the admitted ones are
  # written.
  #
  # Requests that come together are written together: a request that arrives takes with
  # it the requests already in the mailbox behind it (up to @batch in all), admits each
  # in its order, and writes them in one port command, so that a burst (many callers)
  # costs one write and one wake-up of the Python reader, not one each: 1.5-2 us of BEAM
  # CPU less a call at 64 callers (bench/results/least-path-and-batching.md, "Requests
  # that arrive together, written together"). Only requests are taken ahead of the other
  # messages, and a caller sends its settle or credit after its request, so each still
  # follows its own request. With no other request waiting (one caller) it costs one
  # `receive ... after 0`.
  #
  # That receive is selective: it walks the messages that are not requests. A mailbox
  # that has grown long (a flood of replies in 64 KiB pieces, log frames, `Worker.call`s
  # outside any pool's bound) is not walked: past @walk_max messages the request is
  # written alone, as it arrived, so the cost of a request never grows with the backlog.

  require VllmBridge.Worker.Messages

  alias VllmBridge.Worker.{Calls, Messages}
  alias VllmBridge.Worker.Messages.Submit

  @batch 64
  @walk_max 128

  @doc false
  # One request, written alone (or refused).
  @spec one(map(), Submit.t()) :: map()
  def one(state, %Submit{} = s) do
    case admit(state, s) do
      {state, nil} -> state
      {state, frame} -> write(state, frame)
    end
  end

  @doc false
  # A request that arrived in the mailbox, with those behind it (above).
  @spec arrived(map(), Submit.t()) :: map()
  def arrived(state, %Submit{} = s) do
    {:message_queue_len, queued} = Process.info(self(), :message_queue_len)

    if queued > @walk_max do
      one(state, s)
    else
      case admit(state, s) do
        {state, nil} -> more(state, [], 1)
        {state, frame} -> more(state, [frame], 1)
      end
    end
  end

  defp more(state, frames, n) when n < @batch do
    receive do
      Messages.submit(s) ->
        case admit(state, s) do
          {state, nil} -> more(state, frames, n + 1)
          {state, frame} -> more(state, [frame | frames], n + 1)
        end
    after
      0 -> write(state, :lists.reverse(frames))
    end
  end

  defp more(state, frames, _n), do: write(state, :lists.reverse(frames))

  @doc false
  # Writes `iodata` to the worker's port. A port that has closed (its process exited: the
  # `exit_status` is in the mailbox, behind this request) takes nothing: the write is
  # dropped, and the exit, handled next (VllmBridge.Worker.Down), answers every call in
  # the table, those just admitted included, with why the worker went.
  @spec write(map(), iodata()) :: map()
  def write(state, []), do: state

  def write(state, iodata) do
    Port.command(state.port, iodata)
    state
  rescue
    ArgumentError -> state
  end

  # A request into the table of calls: `{state, frame to write}`, or `{state, nil}` when
  # the table refused it (its caller is answered). A stream's reader is told the window
  # first (before any chunk can reach it). (A body too long to be framed, frame nil, is
  # over any limit and refused: `max_frame` is capped at what a frame's length can say.)
  defp admit(state, %Submit{} = s) do
    case Calls.admit(state.calls, s, state.max_frame) do
      {:ok, calls} ->
        if s.replies == :stream, do: Messages.send_window(s.alias, state.stream_window)
        {%{state | calls: Calls.add(calls, s)}, s.frame}

      {:refused, calls} ->
        {%{state | calls: calls}, nil}
    end
  end
end
