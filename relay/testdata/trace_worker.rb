# A Sidekiq worker for relay's trace tests (trace_sidekiq_test.go): a server
# middleware, in plain Ruby, prints each job's traceparent and tracestate as
# the job hash holds them, where opentelemetry-ruby's Sidekiq
# instrumentation extracts them (OpenTelemetry.propagation.extract(msg)).
require "sidekiq"
require "json"

class RecordTrace
  def call(_worker, job, _queue)
    $stdout.puts "traced " + JSON.generate({"jid" => job["jid"], "traceparent" => job["traceparent"], "tracestate" => job["tracestate"]})
    $stdout.flush
    yield
  end
end

class TracedJob
  include Sidekiq::Worker

  def perform(*); end
end

Sidekiq.configure_server do |config|
  # Poll the schedule every second or so (Sidekiq 6.4 waits up to 5s more
  # before its first poll), so that scheduled jobs run within seconds.
  Sidekiq.options[:poll_interval_average] = 1
  config.server_middleware { |chain| chain.add RecordTrace }
end
