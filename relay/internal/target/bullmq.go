package target

// BullMQ 6: the handoff's Lua op handoff.BullMQAdd (relay/bullmq.go).
func init() {
	Register(Spec{
		Name:        "bullmq",
		Order:       4,
		Help:        "bullmq (BullMQ 6)",
		Length:      "LLEN+LLEN+ZCARD",
		TraceSystem: "bullmq",
		Goldens:     []string{"bullmq_standard.json", "bullmq_prioritized.json", "bullmq_delayed.json"},
	})
}
