package main

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	coltrace "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/protobuf/proto"

	"github.com/stagedrain/stagedrain/relay/relaytest"
)

// exportedSpan is a span an OTLP/HTTP receiver got, with its service.name.
type exportedSpan struct {
	service string
	span    *tracepb.Span
}

// spanReceiver is an OTLP/HTTP endpoint that decodes the spans it receives.
func spanReceiver(t *testing.T) (url string, spans func() []exportedSpan) {
	var mu sync.Mutex
	var got []exportedSpan
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		var req coltrace.ExportTraceServiceRequest
		if err := proto.Unmarshal(body, &req); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		mu.Lock()
		for _, rs := range req.ResourceSpans {
			service := ""
			for _, a := range rs.GetResource().GetAttributes() {
				if a.Key == "service.name" {
					service = a.GetValue().GetStringValue()
				}
			}
			for _, ss := range rs.ScopeSpans {
				for _, s := range ss.Spans {
					got = append(got, exportedSpan{service, s})
				}
			}
		}
		mu.Unlock()
		w.Header().Set("Content-Type", "application/x-protobuf")
		b, _ := proto.Marshal(&coltrace.ExportTraceServiceResponse{})
		_, _ = w.Write(b)
	}))
	t.Cleanup(srv.Close)
	return srv.URL, func() []exportedSpan { mu.Lock(); defer mu.Unlock(); return append([]exportedSpan(nil), got...) }
}

// stagedrain run with OTEL_EXPORTER_OTLP_ENDPOINT exports one span per
// batch over OTLP/HTTP, as service "stagedrain", linked to the trace a job
// was staged in (set with one line of SQL), with the messaging attributes.
func TestRunExportsBatchSpans(t *testing.T) {
	t.Parallel()
	url, spans := spanReceiver(t)
	e := newRelayEnv(t)
	p := startProc(t, "relay", childEnv("OTEL_EXPORTER_OTLP_ENDPOINT="+url, "OTEL_BSP_SCHEDULE_DELAY=50"),
		"run", "--schema", e.schema, "--redis-namespace", e.ns)
	if got, want := p.waitLog(rootLogger, "starting", 15*time.Second).str("tracing"), "otlp-http "+url; got != want {
		t.Errorf("the starting line says tracing %q, want %q", got, want)
	}
	p.waitLog(rootLogger, "became leader", 15*time.Second)

	const traceID = "4bf92f3577b34da6a3ce929d0e0e4736"
	if _, err := e.conn.Exec(context.Background(), "INSERT INTO "+pgx.Identifier{e.schema, "staged_jobs"}.Sanitize()+
		` (job_name, job_args, options) VALUES ('WelcomeEmailJob', '[42]',
		jsonb_build_object('traceparent', '00-`+traceID+`-00f067aa0ba902b7-01'))`); err != nil {
		t.Fatal(err)
	}
	var batch *tracepb.Span
	var service string
	relaytest.WaitFor(t, 15*time.Second, "a batch span linked to the staged trace", func() (bool, string) {
		got := spans()
		for _, s := range got {
			for _, l := range s.span.Links {
				if hex.EncodeToString(l.TraceId) == traceID && hex.EncodeToString(l.SpanId) == "00f067aa0ba902b7" {
					batch, service = s.span, s.service
					return true, ""
				}
			}
		}
		return false, fmt.Sprintf("%d spans; output:\n%s", len(got), p.tail(20))
	})
	attrs := map[string]string{}
	for _, a := range batch.Attributes {
		attrs[a.Key] = fmt.Sprint(a.GetValue().GetStringValue(), a.GetValue().GetIntValue())
	}
	if service != "stagedrain" || batch.Name != "send default" || batch.Kind != tracepb.Span_SPAN_KIND_PRODUCER ||
		attrs["messaging.system"] != "sidekiq0" || attrs["messaging.destination.name"] != "default0" ||
		attrs["messaging.batch.message_count"] != "1" {
		t.Errorf("span %q kind %v of service %q, attributes %v: want \"send default\", producer, stagedrain, sidekiq, default, 1",
			batch.Name, batch.Kind, service, attrs)
	}
	p.signal(syscall.SIGTERM)
	if code := p.wait(15 * time.Second); code != 0 {
		t.Fatalf("exit code %d after SIGTERM; output:\n%s", code, p.output())
	}
}

// stagedrain run with OTEL_TRACES_EXPORTER=console, and no collector,
// writes each batch's span as a JSON line on stderr, linked to the trace a
// job was staged in, while its logs stay JSON lines on stdout; the starting
// line says where spans go. Without any OTEL_* variable it says "off".
func TestRunConsoleTraces(t *testing.T) {
	t.Parallel()
	e := newRelayEnv(t)
	p := startProc(t, "relay", childEnv("OTEL_TRACES_EXPORTER=console"), "run", "--schema", e.schema, "--redis-namespace", e.ns)
	if got := p.waitLog(rootLogger, "starting", 15*time.Second).str("tracing"); got != "console (stderr)" {
		t.Errorf("the starting line says tracing %q, want \"console (stderr)\"", got)
	}
	p.waitLog(rootLogger, "became leader", 15*time.Second)

	const traceID = "4bf92f3577b34da6a3ce929d0e0e4736"
	if _, err := e.conn.Exec(context.Background(), "INSERT INTO "+pgx.Identifier{e.schema, "staged_jobs"}.Sanitize()+
		` (job_name, job_args, options) VALUES ('WelcomeEmailJob', '[42]',
		jsonb_build_object('traceparent', '00-`+traceID+`-00f067aa0ba902b7-01'))`); err != nil {
		t.Fatal(err)
	}
	// stdouttrace's span: {"Name":..., "SpanKind":..., "Links":[{"SpanContext":{"TraceID":...}}], ...}
	type consoleSpan struct {
		Name     string
		SpanKind int
		Links    []struct {
			SpanContext struct{ TraceID, SpanID string }
		}
	}
	line, err := p.stderr.wait(15*time.Second, func(l logLine) bool {
		var s consoleSpan
		return json.Unmarshal([]byte(l.raw), &s) == nil && len(s.Links) == 1 && s.Links[0].SpanContext.TraceID == traceID
	})
	if err != nil {
		t.Fatalf("no span on stderr linked to the staged trace: %v; output:\n%s", err, p.output())
	}
	var span consoleSpan
	_ = json.Unmarshal([]byte(line.raw), &span)
	if span.Name != "send default" || span.Links[0].SpanContext.SpanID != "00f067aa0ba902b7" {
		t.Errorf("span %q linked to span %s, want \"send default\" linked to 00f067aa0ba902b7: %s", span.Name, span.Links[0].SpanContext.SpanID, line.raw)
	}
	p.signal(syscall.SIGTERM)
	if code := p.wait(15 * time.Second); code != 0 {
		t.Fatalf("exit code %d after SIGTERM; output:\n%s", code, p.output())
	}
	// The logs on stdout, the spans on stderr: no span among the logs.
	checkAllJSON(t, p)
	for _, l := range p.stdout.snapshot() {
		if strings.Contains(l.raw, `"SpanContext"`) {
			t.Errorf("a span on stdout, among the logs: %s", l.raw)
		}
	}

	off := startProc(t, "relay without tracing", childEnv(), "run", "--schema", e.schema, "--redis-namespace", e.ns)
	if got := off.waitLog(rootLogger, "starting", 15*time.Second).str("tracing"); got != "off" {
		t.Errorf("without OTEL_* variables the starting line says tracing %q, want \"off\"", got)
	}
	off.signal(syscall.SIGTERM)
	if code := off.wait(15 * time.Second); code != 0 {
		t.Fatalf("exit code %d after SIGTERM; output:\n%s", code, off.output())
	}
}
