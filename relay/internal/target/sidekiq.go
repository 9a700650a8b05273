package target

// Sidekiq: SADD queues, LPUSH queue:<q>, ZADD schedule (relay/sidekiq.go).
func init() {
	Register(Spec{
		Name:        "sidekiq",
		Order:       1,
		Help:        "sidekiq",
		NoCluster:   "Sidekiq's keys (queue:<name>, queues, schedule) have no hash tags, and Sidekiq does not support Redis Cluster (use a single Redis or Sentinel, or the asynq or streams target)",
		Timestamps:  true,
		Length:      "LLEN",
		TraceSystem: "sidekiq",
		Goldens:     []string{"sidekiq_immediate_seconds.json", "sidekiq_immediate_millis.json", "sidekiq_scheduled_seconds.json", "sidekiq_scheduled_millis.json", "sidekiq_tenant.json", "sidekiq_staged_push_rows.json", "sidekiq_staged_push_tenant.json", "article_table.json"},
	})
}
