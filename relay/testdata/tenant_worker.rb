# A Sidekiq worker for relay's tenant test (tenant_sidekiq_test.go), in plain
# Ruby: a server middleware that switches to the tenant the job hash names
# in item['apartment'] around perform, as apartment-sidekiq's does
# (Apartment::Tenant.switch(item['apartment']) { yield }), and a job that
# records the tenant it ran in: HSET tenant_seen <jid> <tenant as JSON>
# (null when the job named none).
require "sidekiq"
require "json"

module Tenant
  def self.current
    Thread.current[:tenant]
  end

  def self.switch(name)
    before = Thread.current[:tenant]
    Thread.current[:tenant] = name
    yield
  ensure
    Thread.current[:tenant] = before
  end
end

class TenantMiddleware
  def call(_worker, item, _queue)
    Tenant.switch(item["apartment"]) { yield }
  end
end

class TenantJob
  include Sidekiq::Worker

  def perform(*)
    Sidekiq.redis { |c| c.hset("tenant_seen", jid, JSON.generate(Tenant.current)) }
  end
end

Sidekiq.configure_server do |config|
  config.server_middleware { |chain| chain.add TenantMiddleware }
end
