import Config

# The console shows warnings and errors only while the tests run: pools started outside
# capture_log would print each worker's "ready" info line. Logger's own level stays
# :debug, so capture_log (and the tests' log collector) still get every level.
config :logger, :console, level: :warning
