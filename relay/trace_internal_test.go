package relay

import (
	"context"
	"fmt"
	"testing"
	"time"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/stagedrain/stagedrain/relay/internal/handoff"
	targets "github.com/stagedrain/stagedrain/relay/internal/target"
)

// BenchmarkBatchSpan measures the relay's batch span over a 1000-job batch
// whose jobs all carry a trace context: one op is one job. With tracing
// off it must cost nothing; on, it decodes each job's options and links
// the first maxBatchLinks.
func BenchmarkBatchSpan(b *testing.B) {
	now := time.Now()
	batch := make([]stagedJob, 1000)
	for i := range batch {
		batch[i] = stagedJob{id: int64(i), queue: "default", createdAt: now,
			options: []byte(`{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}`)}
	}
	for _, on := range []bool{false, true} {
		b.Run(fmt.Sprintf("tracing=%v", on), func(b *testing.B) {
			var bt *batchTracer
			if on {
				tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(tracetest.NewSpanRecorder()))
				defer func() { _ = tp.Shutdown(context.Background()) }()
				bt = newBatchTracer(tp, TargetSidekiq)
			}
			res := pushResult{queues: []string{"default"}}
			b.ReportAllocs()
			n := 0
			for b.Loop() {
				if n%len(batch) == 0 {
					span := bt.start(context.Background(), claimed{jobs: batch, start: now})
					bt.end(span, &res, 0, nil)
				}
				n++
			}
		})
	}
}

// With tracing off, a batch of jobs that all carry a trace context costs
// the relay's span code no allocation at all.
func TestBatchSpanOffAllocatesNothing(t *testing.T) {
	batch := make([]stagedJob, 100)
	for i := range batch {
		batch[i] = stagedJob{id: int64(i), options: []byte(`{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}`)}
	}
	bt := newBatchTracer(nil, TargetSidekiq)
	res := pushResult{}
	if n := testing.AllocsPerRun(10, func() {
		bt.end(bt.start(context.Background(), claimed{jobs: batch}), &res, 0, nil)
	}); n != 0 {
		t.Errorf("tracing off: %v allocations per batch, want 0", n)
	}
}

// The "job refused by Redis, left staged" line finds its job's trace id by
// the job's id.
func TestTraceIDOf(t *testing.T) {
	batch := []stagedJob{{id: 1, options: []byte(`{}`)},
		{id: 2, options: []byte(`{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}`)},
		{id: 3, options: []byte(`{"traceparent": "garbage"}`)}}
	if f := traceIDOf(batch, 2); f.Key != "trace_id" || f.String != "0af7651916cd43dd8448eb211c80319c" {
		t.Errorf("traceIDOf(2) = %+v, want trace_id 0af7651916cd43dd8448eb211c80319c", f)
	}
	for _, id := range []int64{1, 3, 4} {
		if f := traceIDOf(batch, id); f.Key != "" {
			t.Errorf("traceIDOf(%d) = %+v, want no field", id, f)
		}
	}
}

// BenchmarkBatchBuildOptions measures BenchmarkBatchBuild's sidekiq batch
// when every job has options: a traceparent (as Stage writes it in a span),
// or, for comparison, another option of the same kind (retry). One op is
// one job.
func BenchmarkBatchBuildOptions(b *testing.B) {
	for name, opts := range map[string]string{
		"traceparent": `{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}`,
		"retry":       `{"retry": 3}`,
	} {
		b.Run(name, func(b *testing.B) {
			now := time.Now()
			batch := make([]stagedJob, 1000)
			for i := range batch {
				batch[i] = stagedJob{id: int64(i), name: "WelcomeEmailJob", args: []byte(`[42, "welcome", {"locale": "en"}]`),
					queue: fmt.Sprintf("q%d", i%4), jid: "0123456789abcdef01234567", createdAt: now, options: []byte(opts)}
			}
			s := builtin(TargetSidekiq, targets.Options{MaxPayload: defaultMaxPayloadBytes})
			var u handoff.Unit
			var res pushResult
			b.ReportAllocs()
			n := 0
			for b.Loop() {
				if n%len(batch) == 0 {
					res = pushResult{queues: res.queues[:0]}
					u.Reset()
					s.add(&u, batch, now, &res)
				}
				n++
			}
			if len(res.rejected) != 0 {
				b.Fatalf("%d jobs rejected", len(res.rejected))
			}
		})
	}
}
