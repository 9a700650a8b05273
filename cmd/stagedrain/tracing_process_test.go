package main

import (
	"context"
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
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
