package relay_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// The app's and the workers' propagator: W3C trace context, as an app that
// sets up OpenTelemetry configures it (otel's default propagator injects
// nothing).
func init() { otel.SetTextMapPropagator(propagation.TraceContext{}) }

// recorder is an in-memory tracer provider: the app's, the relay's and the
// worker's spans all go to it.
func recorder(t *testing.T) (*tracetest.SpanRecorder, *sdktrace.TracerProvider) {
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	return rec, tp
}

// stageInSpan stages jobs in one transaction inside an app span "signup",
// and returns the span's context and the jids.
func stageInSpan(t *testing.T, h *harness, tp trace.TracerProvider, jobs ...relay.Job) (trace.SpanContext, []string) {
	t.Helper()
	ctx, span := tp.Tracer("app").Start(context.Background(), "signup")
	defer span.End()
	var jids []string
	err := pgx.BeginFunc(ctx, h.conn, func(tx pgx.Tx) error {
		var err error
		jids, err = h.stager.StageMany(ctx, tx, jobs)
		return err
	})
	if err != nil {
		t.Fatalf("stage: %v", err)
	}
	return span.SpanContext(), jids
}

// workerSpan is what a worker's middleware saw of a job.
type workerSpan struct {
	name   string
	parent trace.SpanContext // of the span the worker started from the job's context
	self   trace.SpanContext
}

// startWorkerSpan starts the worker's span from a carrier, through the
// configured propagator, as a worker's instrumentation does.
func startWorkerSpan(tp trace.TracerProvider, name string, carrier propagation.TextMapCarrier) workerSpan {
	ctx := otel.GetTextMapPropagator().Extract(context.Background(), carrier)
	_, span := tp.Tracer("worker").Start(ctx, "process "+name, trace.WithSpanKind(trace.SpanKindConsumer))
	defer span.End()
	return workerSpan{name: name, parent: trace.SpanContextFromContext(ctx), self: span.SpanContext()}
}

// checkBatchSpan finds the relay's batch span linked to app and checks its
// messaging attributes.
func checkBatchSpan(t *testing.T, rec *tracetest.SpanRecorder, app trace.SpanContext, system, dest string) {
	t.Helper()
	// The batch span ends after the commit, which may be after the worker
	// ran the job.
	var s sdktrace.ReadOnlySpan
	testenv.WaitFor(t, 10*time.Second, "the relay's batch span linked to the app's", func() (bool, string) {
		for _, e := range rec.Ended() {
			if e.InstrumentationScope().Name == "github.com/stagedrain/stagedrain/relay" &&
				slices.ContainsFunc(e.Links(), func(l sdktrace.Link) bool {
					return l.SpanContext.TraceID() == app.TraceID() && l.SpanContext.SpanID() == app.SpanID()
				}) {
				s = e
				return true, ""
			}
		}
		return false, fmt.Sprintf("spans: %v", spanNames(rec))
	})
	{
		attrs := map[attribute.Key]attribute.Value{}
		for _, a := range s.Attributes() {
			attrs[a.Key] = a.Value
		}
		if attrs["messaging.system"].AsString() != system || attrs["messaging.destination.name"].AsString() != dest ||
			attrs["messaging.batch.message_count"].AsInt64() < 1 || s.Name() != "send "+dest || s.SpanKind() != trace.SpanKindProducer {
			t.Errorf("batch span %q kind %v attributes %v: want send %s, producer, messaging.system %s, destination %s, a message count", s.Name(), s.SpanKind(), attrs, dest, system, dest)
		}
		var events []string
		for _, e := range s.Events() {
			events = append(events, e.Name)
		}
		if !slices.Equal(events, []string{"pushed", "committed"}) {
			t.Errorf("batch span events %v, want pushed, committed", events)
		}
		if s.Parent().IsValid() {
			t.Errorf("batch span has parent %v, want a root span (linked to the jobs)", s.Parent())
		}
	}
}

func spanNames(rec *tracetest.SpanRecorder) []string {
	var names []string
	for _, s := range rec.Ended() {
		names = append(names, fmt.Sprintf("%s(links %d)", s.Name(), len(s.Links())))
	}
	return names
}

// An asynq server's middleware starts the worker's span from the task's
// headers: its parent is the span that staged the job, through the
// relay's batch span (linked). A job staged with no span carries no
// context, and a malformed traceparent is dropped, with a debug line,
// while the job still runs.
func TestTraceAsynqWorkerSpanIsChildOfStagingSpan(t *testing.T) {
	t.Parallel()
	h, rdb, cfg := newAsynqHarness(t)
	rec, tp := recorder(t)
	cfg.TracerProvider = tp
	seen := make(chan workerSpan, 10)
	headers := make(chan map[string]string, 10)
	mux := asynq.NewServeMux()
	mux.Use(func(next asynq.Handler) asynq.Handler {
		return asynq.HandlerFunc(func(ctx context.Context, task *asynq.Task) error {
			headers <- task.Headers()
			seen <- startWorkerSpan(tp, task.Type(), propagation.MapCarrier(task.Headers()))
			return next.ProcessTask(ctx, task)
		})
	})
	mux.HandleFunc("Traced", func(context.Context, *asynq.Task) error { return nil })
	mux.HandleFunc("Untraced", func(context.Context, *asynq.Task) error { return nil })
	mux.HandleFunc("Malformed", func(context.Context, *asynq.Task) error { return nil })
	srv := asynq.NewServerFromRedisClient(rdb, asynq.Config{
		Concurrency: 1, Queues: map[string]int{"mailers": 1}, TaskCheckInterval: 20 * time.Millisecond,
		LogLevel: asynq.ErrorLevel,
	})
	if err := srv.Start(mux); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Shutdown)
	h.start(cfg)

	app, _ := stageInSpan(t, h, tp, relay.Job{Name: "Traced", Queue: "mailers",
		Options: map[string]any{"headers": map[string]string{"tenant": "7"}}})
	h.stageMany(relay.Job{Name: "Untraced", Queue: "mailers"},
		relay.Job{Name: "Malformed", Queue: "mailers", Options: map[string]any{"traceparent": "00-not-a-trace", "tracestate": "a=b"}})

	got := map[string]workerSpan{}
	hdrs := map[string]map[string]string{}
	for range 3 {
		select {
		case w := <-seen:
			got[w.name], hdrs[w.name] = w, <-headers
		case <-time.After(15 * time.Second):
			t.Fatalf("tasks handled: %v; logs: %v", got, messages(h.logs))
		}
	}
	w := got["Traced"]
	if !w.parent.IsRemote() || w.parent.SpanID() != app.SpanID() || w.self.TraceID() != app.TraceID() {
		t.Errorf("worker span started from parent %v (trace %s), want the staging span %s of trace %s",
			w.parent.SpanID(), w.self.TraceID(), app.SpanID(), app.TraceID())
	}
	if hdrs["Traced"]["tenant"] != "7" {
		t.Errorf("Traced headers %v: the headers option was lost", hdrs["Traced"])
	}
	for _, name := range []string{"Untraced", "Malformed"} {
		if got[name].parent.IsValid() || hdrs[name]["traceparent"] != "" || hdrs[name]["tracestate"] != "" {
			t.Errorf("%s: headers %v, worker parent %v: want no trace context", name, hdrs[name], got[name].parent)
		}
	}
	checkBatchSpan(t, rec, app, "asynq", "mailers")
	h.waitLog("malformed trace context dropped, job pushed without it", 1)
	if n := h.staged(); n != 0 {
		t.Errorf("%d rows left staged", n)
	}
}

// A Streams consumer reads the trace context from the entry's fields, and
// its span's parent is the span that staged the job.
func TestTraceStreamsConsumerSpanIsChildOfStagingSpan(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	h := newHarness(t)
	rec, tp := recorder(t)
	cfg := h.config()
	cfg.Target, cfg.TracerProvider = relay.TargetStreams, tp
	stream := h.key("stream:events")
	h.start(cfg)

	// The app's tracer keeps a tracestate, which goes along too.
	ts, err := trace.ParseTraceState("vendor=abc")
	if err != nil {
		t.Fatal(err)
	}
	parent := trace.ContextWithSpanContext(ctx, trace.NewSpanContext(trace.SpanContextConfig{
		TraceID: trace.TraceID{1, 2, 3}, SpanID: trace.SpanID{4, 5, 6}, TraceFlags: trace.FlagsSampled, TraceState: ts, Remote: true}))
	appCtx, span := tp.Tracer("app").Start(parent, "signup")
	err = pgx.BeginFunc(appCtx, h.conn, func(tx pgx.Tx) error {
		_, err := h.stager.Stage(appCtx, tx, relay.Job{Name: "UserSignedUp", Queue: "events", Args: []any{42}})
		return err
	})
	span.End()
	if err != nil {
		t.Fatal(err)
	}
	app := span.SpanContext()

	var entries []redis.XMessage
	for len(entries) == 0 {
		res, err := h.rdb.XRead(ctx, &redis.XReadArgs{Streams: []string{stream, "0"}, Count: 10, Block: 10 * time.Second}).Result()
		if err != nil {
			t.Fatalf("XREAD: %v; logs: %v", err, messages(h.logs))
		}
		entries = res[0].Messages
	}
	fields := propagation.MapCarrier{}
	for k, v := range entries[0].Values {
		fields[k], _ = v.(string)
	}
	if _, ok := fields["options"]; ok {
		t.Errorf("entry %v has an options field: options of the trace context alone are not written", fields)
	}
	w := startWorkerSpan(tp, "UserSignedUp", fields)
	if w.parent.SpanID() != app.SpanID() || w.self.TraceID() != app.TraceID() {
		t.Errorf("consumer span's parent %v (trace %s), want the staging span %s (trace %s); entry %v",
			w.parent.SpanID(), w.self.TraceID(), app.SpanID(), app.TraceID(), fields)
	}
	if fields["tracestate"] != "vendor=abc" {
		t.Errorf("entry tracestate %q, want vendor=abc", fields["tracestate"])
	}
	checkBatchSpan(t, rec, app, "redis", "events")
}

// Stage leaves options alone with no span in ctx; in a span, through the
// W3C propagator, the options hold exactly the span's traceparent; a
// traceparent the job's Options set is kept.
func TestStageTraceContextInOptions(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	_, tp := recorder(t)
	jid := h.stage(relay.Job{Name: "NoSpan", Options: map[string]any{"retry": 2}})
	app, jids := stageInSpan(t, h, tp, relay.Job{Name: "InSpan"}, relay.Job{Name: "Own",
		Options: map[string]any{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}})
	opts := map[string]string{}
	rows, err := h.conn.Query(context.Background(), `SELECT jid, options::text FROM `+pgx.Identifier{h.schema, "staged_jobs"}.Sanitize())
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var j, o string
		if err := rows.Scan(&j, &o); err != nil {
			t.Fatal(err)
		}
		opts[j] = o
	}
	if rows.Err() != nil {
		t.Fatal(rows.Err())
	}
	want := fmt.Sprintf(`{"traceparent": "00-%s-%s-01"}`, app.TraceID(), app.SpanID())
	if opts[jid] != `{"retry": 2}` || opts[jids[0]] != want ||
		opts[jids[1]] != `{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}` {
		t.Errorf("options %v: want no span -> {\"retry\": 2}, in span -> %s, own traceparent kept", opts, want)
	}
	if strings.Contains(opts[jid], "trace") {
		t.Errorf("a job staged with no span carries %s", opts[jid])
	}
}

// The line that says a job was dead-lettered names the trace the job was
// staged in; a job staged with no span gets no trace_id.
func TestTraceDeadLetteredLogsTraceID(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	_, tp := recorder(t)
	cfg := h.config()
	cfg.MaxPayloadBytes = 500
	h.start(cfg)
	big := strings.Repeat("x", 600)
	app, jids := stageInSpan(t, h, tp, relay.Job{Name: "Big", Args: []any{big}})
	plain := h.stage(relay.Job{Name: "Big", Args: []any{big}})
	h.waitLog("job dead-lettered", 2)
	for _, e := range h.logs.FilterMessage("job dead-lettered").All() {
		f := e.ContextMap()
		switch f["jid"] {
		case jids[0]:
			if f["trace_id"] != app.TraceID().String() {
				t.Errorf("dead-lettered line %v: want trace_id %s", f, app.TraceID())
			}
		case plain:
			if _, ok := f["trace_id"]; ok {
				t.Errorf("dead-lettered line %v of a job staged with no span has a trace_id", f)
			}
		}
	}
}

// A job Redis refuses for good (WRONGTYPE: its queue's key is a string) is
// dead-lettered, and the line names the trace it was staged in; the job
// beside it, in the same trace, is delivered with its traceparent.
func TestTraceRefusedJobLogsTraceID(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	_, tp := recorder(t)
	ctx := context.Background()
	if err := h.rdb.Set(ctx, h.key("queue:blocked"), "not a list", 0).Err(); err != nil {
		t.Fatal(err)
	}
	h.start(h.config())
	app, jids := stageInSpan(t, h, tp, relay.Job{Name: "Blocked", Queue: "blocked"}, relay.Job{Name: "Ok", Queue: "ok"})
	h.waitLog("job dead-lettered", 1)
	f := h.logs.FilterMessage("job dead-lettered").All()[0].ContextMap()
	if f["jid"] != jids[0] || f["trace_id"] != app.TraceID().String() || !strings.Contains(fmt.Sprint(f["reason"]), "WRONGTYPE") {
		t.Errorf("dead-lettered line %v: want jid %s, a WRONGTYPE reason and trace_id %s", f, jids[0], app.TraceID())
	}
	h.waitQueueLen("ok", 1, 10*time.Second)
	if got := h.queue("ok")[0]; got["traceparent"] != fmt.Sprintf("00-%s-%s-01", app.TraceID(), app.SpanID()) {
		t.Errorf("queue:ok job %v: want the staging span's traceparent", got)
	}
}

// A hot fleet's shared drain traces each schema's batch as a schema's own
// drain does: a span per batch, linked to the spans that staged its jobs,
// with its pushed and committed events (fleetdrain.go). One app span stages
// a job in each of two schemas, which the next hot poll finds together.
func TestTraceFleetSharedDrain(t *testing.T) {
	t.Parallel()
	rec, tp := recorder(t)
	fh := newFleetHarness(t, 2)
	ctx := context.Background()
	cfg := fh.fleetConfig()
	cfg.TracerProvider = tp
	r, bc := startHotFleet(t, fh, cfg)
	fh.waitJIDs("busy", bc.stop())

	var app trace.SpanContext
	var dest string // the last run's queue
	untilShared(t, r, func(run int) {
		dest = fmt.Sprintf("together%d", run)
		sctx, span := tp.Tracer("app").Start(ctx, "signup")
		defer span.End()
		app = span.SpanContext()
		fh.waitJIDs(dest, fh.stageAcross(sctx, fh.schemas, dest))
	})
	checkBatchSpan(t, rec, app, "sidekiq", dest)
	testenv.WaitFor(t, 10*time.Second, "a batch span per schema, linked to the app's", func() (bool, string) {
		n := 0
		for _, e := range rec.Ended() {
			if slices.ContainsFunc(e.Links(), func(l sdktrace.Link) bool { return l.SpanContext.SpanID() == app.SpanID() }) {
				n++
			}
		}
		return n == 2, fmt.Sprintf("%d linked spans: %v", n, spanNames(rec))
	})
}
