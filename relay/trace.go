package relay

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"strings"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
	"go.uber.org/zap"

	targets "github.com/stagedrain/stagedrain/relay/internal/target"
)

// A staged job carries W3C trace context (https://www.w3.org/TR/trace-context/)
// as two keys of its options: "traceparent" and, when there is one,
// "tracestate", both JSON strings. Each target puts them where that job
// system's OpenTelemetry instrumentation reads them:
//
//   - sidekiq: top-level keys of the job hash, as every option is. That is
//     where opentelemetry-ruby-contrib's Sidekiq instrumentation injects and
//     extracts them: the job hash is its carrier,
//     OpenTelemetry.propagation.inject(job) in
//     instrumentation/sidekiq/lib/opentelemetry/instrumentation/sidekiq/middlewares/client/tracer_middleware.rb
//     and OpenTelemetry.propagation.extract(msg) in
//     instrumentation/sidekiq/lib/opentelemetry/instrumentation/sidekiq/middlewares/server/tracer_middleware.rb
//     (github.com/open-telemetry/opentelemetry-ruby-contrib).
//   - asynq: the task's headers (TaskMessage field 15, Task.Headers() in
//     v0.26.0), beside any "headers" option; these two keys win.
//   - streams: entry fields "traceparent" and "tracestate".
//   - celery: headers of the task message. opentelemetry-instrumentation-celery
//     injects them into the message's headers (_trace_before_publish,
//     inject(headers)) and extracts them from task.request, whose
//     attributes the worker sets from the headers (_trace_prerun,
//     extract(request, getter=celery_getter), a getattr), in
//     instrumentation/opentelemetry-instrumentation-celery/src/opentelemetry/instrumentation/celery/__init__.py
//     (github.com/open-telemetry/opentelemetry-python-contrib).
//
// A traceparent that is not a JSON string of the W3C form is dropped (and
// its tracestate with it): the job goes on without it, and the relay logs
// a debug line. It never makes the row poison.
const (
	traceparentKey = targets.TraceparentKey
	tracestateKey  = targets.TracestateKey
)

// maxBatchLinks caps the links of a batch span to the staged jobs' spans.
const maxBatchLinks = 128

// hasTraceOption reports, without decoding, whether a row's options may
// hold a trace context.
func hasTraceOption(options []byte) bool {
	return bytes.Contains(options, []byte(traceparentKey))
}

// traceOptions is target.TraceOptions: the trace context of a row's
// decoded options, the same the targets write.
func traceOptions(opts map[string]json.RawMessage) (tp, ts, bad string) {
	return targets.TraceOptions(opts)
}

func truncate(s string, n int) string { return targets.Truncate(s, n) }

// jobTrace returns the trace context a row carries; bad says why its
// traceparent was dropped, if it was. It decodes the options: call it only
// where a job is logged or tracing is on.
func jobTrace(j *stagedJob) (tp, ts, bad string) {
	if !hasTraceOption(j.options) {
		return "", "", ""
	}
	var opts map[string]json.RawMessage
	if json.Unmarshal(j.options, &opts) != nil {
		return "", "", ""
	}
	return traceOptions(opts)
}

// jobSpanContext is the span context of the span that staged j, if any.
func jobSpanContext(j *stagedJob) (trace.SpanContext, bool) {
	tp, ts, _ := jobTrace(j)
	if tp == "" {
		return trace.SpanContext{}, false
	}
	carrier := propagation.MapCarrier{traceparentKey: tp}
	if ts != "" {
		carrier[tracestateKey] = ts
	}
	sc := trace.SpanContextFromContext(propagation.TraceContext{}.Extract(context.Background(), carrier))
	return sc, sc.IsValid()
}

// traceIDField is a log field with the trace id of the span that staged j,
// or a field that logs nothing when it carries none.
func traceIDField(j *stagedJob) zap.Field {
	tp, _, _ := jobTrace(j)
	if tp == "" {
		return zap.Skip()
	}
	return zap.String("trace_id", tp[3:35])
}

// logDroppedTraces logs, at debug, each job of batch whose traceparent the
// targets dropped as malformed. Nothing is decoded unless debug is on.
func logDroppedTraces(log *zap.Logger, batch []stagedJob) {
	if !log.Core().Enabled(zap.DebugLevel) {
		return
	}
	for i := range batch {
		if _, _, bad := jobTrace(&batch[i]); bad != "" {
			log.Debug("malformed trace context dropped, job pushed without it", zap.Int64("id", batch[i].id),
				zap.String("jid", batch[i].jid), zap.String("reason", bad))
		}
	}
}

// describeTracing is the "tracing" field of the "starting" line: "off"
// without a TracerProvider, what the provider says of itself when it is a
// fmt.Stringer (stagedrain's says where its spans go: "otlp-http
// http://collector:4318", "console (stderr)"), else "on".
func describeTracing(tp trace.TracerProvider) string {
	switch p := tp.(type) {
	case nil:
		return "off"
	case fmt.Stringer:
		return p.String()
	}
	return "on"
}

// batchTracer makes the relay's span of each batch; nil when tracing is
// off (Config.TracerProvider unset), and then it costs nothing.
type batchTracer struct {
	tracer trace.Tracer
	system string // messaging.system
}

func newBatchTracer(tp trace.TracerProvider, target Target) *batchTracer {
	if tp == nil {
		return nil
	}
	system := target.spec().TraceSystem
	return &batchTracer{tracer: tp.Tracer("github.com/stagedrain/stagedrain/relay"), system: system}
}

// start starts the span of batch b, from its claim, linked to the spans
// that staged its jobs (up to maxBatchLinks). It returns nil when tracing is
// off.
func (t *batchTracer) start(ctx context.Context, b claimed) trace.Span {
	if t == nil {
		return nil
	}
	var links []trace.Link
	for i := range b.jobs {
		if len(links) == maxBatchLinks {
			break
		}
		if sc, ok := jobSpanContext(&b.jobs[i]); ok {
			links = append(links, trace.Link{SpanContext: sc})
		}
	}
	_, span := t.tracer.Start(ctx, "send", trace.WithTimestamp(b.start), trace.WithSpanKind(trace.SpanKindProducer),
		trace.WithLinks(links...), trace.WithAttributes(
			attribute.String("messaging.system", t.system),
			attribute.String("messaging.operation.type", "send"),
			attribute.String("messaging.operation.name", "send"),
			attribute.Int("stagedrain.batch.claimed", len(b.jobs)),
		))
	return span
}

// event marks a step of the batch (pushed, committed) on its span.
func (t *batchTracer) event(span trace.Span, name string) {
	if span != nil {
		span.AddEvent(name)
	}
}

// end ends a batch's span with what became of the batch.
func (t *batchTracer) end(span trace.Span, res *pushResult, buried int, err error) {
	if span == nil {
		return
	}
	if err != nil {
		span.RecordError(err)
		span.SetStatus(codes.Error, err.Error())
	}
	if res != nil {
		if len(res.queues) == 1 && res.scheduled == 0 {
			span.SetName("send " + res.queues[0])
			span.SetAttributes(attribute.String("messaging.destination.name", res.queues[0]))
		} else if len(res.queues) > 0 {
			span.SetAttributes(attribute.String("stagedrain.queues", strings.Join(res.queues, ",")))
		}
		span.SetAttributes(
			attribute.Int("messaging.batch.message_count", len(res.pushed)),
			attribute.Int("stagedrain.batch.scheduled", res.scheduled),
			attribute.Int("stagedrain.batch.left_staged", len(res.deferred)),
			attribute.Int("stagedrain.batch.dead_lettered", buried),
		)
	}
	span.End()
}

// traceCarrier takes the trace context a propagator injects, and nothing
// else (no baggage: it would be pushed with every job).
type traceCarrier struct{ traceparent, tracestate string }

func (c *traceCarrier) Get(string) string { return "" }
func (c *traceCarrier) Keys() []string    { return nil }
func (c *traceCarrier) Set(key, value string) {
	switch strings.ToLower(key) {
	case traceparentKey:
		c.traceparent = value
	case tracestateKey:
		c.tracestate = value
	}
}

// withTraceContext adds the trace context of ctx, through the configured
// propagator (otel.GetTextMapPropagator: the app must set one, e.g.
// propagation.TraceContext{}), to a job's options JSON text. With no span
// in ctx, or options that set a traceparent of their own, options is
// returned as is, and nothing is allocated.
func withTraceContext(ctx context.Context, options string, set map[string]any) string {
	if !trace.SpanContextFromContext(ctx).IsValid() {
		return options
	}
	if _, ok := set[traceparentKey]; ok {
		return options
	}
	var c traceCarrier
	otel.GetTextMapPropagator().Inject(ctx, &c)
	if c.traceparent == "" {
		return options
	}
	b := make([]byte, 0, len(options)+len(c.traceparent)+len(c.tracestate)+40)
	b = append(b, options[:len(options)-1]...) // options is a JSON object: drop its '}'
	if options != "{}" {
		b = append(b, ',')
	}
	b = append(b, `"traceparent":`...)
	b = targets.AppendJSONString(b, c.traceparent)
	if _, ok := set[tracestateKey]; !ok && c.tracestate != "" {
		b = append(b, `,"tracestate":`...)
		b = targets.AppendJSONString(b, c.tracestate)
	}
	return string(append(b, '}'))
}

// traceIDOf is traceIDField of the job of batch whose id is id.
func traceIDOf(batch []stagedJob, id int64) zap.Field {
	for i := range batch {
		if batch[i].id == id {
			return traceIDField(&batch[i])
		}
	}
	return zap.Skip()
}
