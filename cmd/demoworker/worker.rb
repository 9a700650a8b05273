# The worker side of the docker-compose demo: a plain Sidekiq worker for the
# WelcomeJob that cmd/demoapp stages in the same transaction as its user,
# and that stagedrain pushes to Redis once that transaction commits.
#
#   REDIS_URL=redis://127.0.0.1:6379/0 sidekiq -r ./cmd/demoworker/worker.rb
#
# Sidekiq::Worker, not Sidekiq::Job: Debian's Sidekiq 6.4 (apt-get install
# ruby-sidekiq) and the Sidekiq 7 of this directory's Dockerfile both accept it.
require "sidekiq"

class WelcomeJob
  include Sidekiq::Worker

  def perform(user_id)
    # A real job would read the user here: it is committed, or the job
    # would not exist.
    logger.info "welcome email for user #{user_id} (jid #{jid})"
  end
end

# The trace the app signed the user up in: the relay puts the traceparent the
# app staged at the top of the job hash, where OpenTelemetry's Sidekiq
# instrumentation would read it. This middleware only logs its trace id.
class TraceLog
  def call(_worker, job, _queue)
    tp = job["traceparent"]
    Sidekiq.logger.info "trace #{tp.split("-")[1]}: welcome email for user #{job["args"][0]}" if tp.is_a?(String) && tp.count("-") >= 3
    yield
  end
end

Sidekiq.configure_server do |config|
  config.server_middleware { |chain| chain.add TraceLog }
end
