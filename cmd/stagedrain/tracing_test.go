package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"testing"

	coltrace "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	"google.golang.org/grpc"
)

// otlpReceiver is an OTLP/HTTP endpoint that counts the trace exports it
// receives.
func otlpReceiver(t *testing.T) (url string, exports func() int) {
	var mu sync.Mutex
	n := 0
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		if r.Method == http.MethodPost && r.URL.Path == "/v1/traces" && len(body) > 0 {
			mu.Lock()
			n++
			mu.Unlock()
		}
		w.Header().Set("Content-Type", "application/x-protobuf")
		w.WriteHeader(http.StatusOK)
	}))
	t.Cleanup(srv.Close)
	return srv.URL, func() int { mu.Lock(); defer mu.Unlock(); return n }
}

// Tracing is set up from the OTEL_* variables only when an OTLP endpoint is
// set and the SDK is not disabled; spans then reach the endpoint over
// OTLP/HTTP, and OTEL_TRACES_SAMPLER is honoured.
func TestTracerProviderFromEnv(t *testing.T) {
	url, exports := otlpReceiver(t)
	for _, k := range []string{"OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_SDK_DISABLED",
		"OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_TRACES_SAMPLER", "OTEL_TRACES_EXPORTER"} {
		t.Setenv(k, "")
		os.Unsetenv(k)
	}
	ctx := context.Background()
	export := func() (bool, int) {
		t.Helper()
		tp, shutdown, err := tracerProvider(ctx, os.Getenv, io.Discard)
		if err != nil {
			t.Fatal(err)
		}
		if tp == nil {
			return false, exports()
		}
		_, span := tp.Tracer("test").Start(ctx, "batch")
		span.End()
		if err := shutdown(ctx); err != nil {
			t.Fatalf("shutdown: %v", err)
		}
		return true, exports()
	}
	if on, _ := export(); on {
		t.Fatal("tracing set up with no OTEL_EXPORTER_OTLP_ENDPOINT")
	}
	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", url)
	if on, n := export(); !on || n != 1 {
		t.Fatalf("with OTEL_EXPORTER_OTLP_ENDPOINT: tracing on %v, %d exports, want on and 1", on, n)
	}
	t.Setenv("OTEL_TRACES_SAMPLER", "always_off")
	if on, n := export(); !on || n != 1 {
		t.Fatalf("OTEL_TRACES_SAMPLER=always_off: tracing on %v, %d exports, want on and still 1", on, n)
	}
	t.Setenv("OTEL_SDK_DISABLED", "true")
	if on, _ := export(); on {
		t.Fatal("tracing set up with OTEL_SDK_DISABLED=true")
	}
	t.Setenv("OTEL_SDK_DISABLED", "")
	t.Setenv("OTEL_TRACES_EXPORTER", "none")
	if on, _ := export(); on {
		t.Fatal("tracing set up with OTEL_TRACES_EXPORTER=none")
	}
	t.Setenv("OTEL_TRACES_EXPORTER", "otlp")
	t.Setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
	var u *usageError
	if _, _, err := tracerProvider(ctx, os.Getenv, io.Discard); !errors.As(err, &u) {
		t.Fatalf("OTEL_EXPORTER_OTLP_PROTOCOL=http/json: %v, want a usage error", err)
	}
}

// grpcCollector is an OTLP/gRPC trace service that counts exports.
type grpcCollector struct {
	coltrace.UnimplementedTraceServiceServer
	mu sync.Mutex
	n  int
}

func (c *grpcCollector) Export(_ context.Context, req *coltrace.ExportTraceServiceRequest) (*coltrace.ExportTraceServiceResponse, error) {
	if len(req.ResourceSpans) > 0 {
		c.mu.Lock()
		c.n++
		c.mu.Unlock()
	}
	return &coltrace.ExportTraceServiceResponse{}, nil
}

// OTEL_EXPORTER_OTLP_PROTOCOL=grpc exports over OTLP/gRPC.
func TestTracerProviderGRPC(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	c := &grpcCollector{}
	coltrace.RegisterTraceServiceServer(srv, c)
	go func() { _ = srv.Serve(l) }()
	t.Cleanup(srv.Stop)
	for _, k := range []string{"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_SDK_DISABLED", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
		"OTEL_TRACES_SAMPLER", "OTEL_TRACES_EXPORTER"} {
		t.Setenv(k, "")
		os.Unsetenv(k)
	}
	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://"+l.Addr().String())
	t.Setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
	ctx := context.Background()
	tp, shutdown, err := tracerProvider(ctx, os.Getenv, io.Discard)
	if err != nil || tp == nil {
		t.Fatalf("tracerProvider = %v, %v; want a provider", tp, err)
	}
	_, span := tp.Tracer("test").Start(ctx, "batch")
	span.End()
	if err := shutdown(ctx); err != nil {
		t.Fatalf("shutdown: %v", err)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.n != 1 {
		t.Fatalf("%d exports over gRPC, want 1", c.n)
	}
}

// OTEL_TRACES_EXPORTER=console writes each span, when it ends, as one JSON
// line on the writer given (run's stderr), with or without an OTLP endpoint
// (then nothing goes to the endpoint); "console,otlp" does both; an
// exporter stagedrain does not have is a usage error. The provider says
// where its spans go.
func TestTracerProviderConsole(t *testing.T) {
	url, exports := otlpReceiver(t)
	for _, k := range []string{"OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_SDK_DISABLED",
		"OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_TRACES_SAMPLER", "OTEL_TRACES_EXPORTER"} {
		t.Setenv(k, "")
		os.Unsetenv(k)
	}
	ctx := context.Background()
	span := func(name string) (where string, lines []string) {
		t.Helper()
		var stderr bytes.Buffer
		tp, shutdown, err := tracerProvider(ctx, os.Getenv, &stderr)
		if err != nil || tp == nil {
			t.Fatalf("tracerProvider = %v, %v; want a provider", tp, err)
		}
		_, s := tp.Tracer("test").Start(ctx, name)
		s.End()
		// A syncer: the span is written when it ends, before any flush.
		written := stderr.String()
		if err := shutdown(ctx); err != nil {
			t.Fatalf("shutdown: %v", err)
		}
		return tp.String(), strings.Split(strings.TrimSuffix(written, "\n"), "\n")
	}
	checkLine := func(lines []string, name string) {
		t.Helper()
		if len(lines) != 1 {
			t.Fatalf("console wrote %d lines, want 1 JSON line per span: %q", len(lines), lines)
		}
		var got struct{ Name string }
		if err := json.Unmarshal([]byte(lines[0]), &got); err != nil || got.Name != name {
			t.Fatalf("console line %q: name %q (%v), want a JSON span named %q", lines[0], got.Name, err, name)
		}
	}

	t.Setenv("OTEL_TRACES_EXPORTER", "console")
	where, lines := span("alone")
	checkLine(lines, "alone")
	if where != "console (stderr)" {
		t.Errorf("console: the provider says %q, want \"console (stderr)\"", where)
	}

	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://user:s3cret@"+strings.TrimPrefix(url, "http://"))
	where, lines = span("beside an endpoint")
	checkLine(lines, "beside an endpoint")
	if n := exports(); n != 0 {
		t.Errorf("console with an OTLP endpoint set: %d OTLP exports, want 0", n)
	}

	t.Setenv("OTEL_TRACES_EXPORTER", "console, otlp")
	where, lines = span("both")
	checkLine(lines, "both")
	if n := exports(); n != 1 {
		t.Errorf("console,otlp: %d OTLP exports, want 1", n)
	}
	if want := "console (stderr), otlp-http http://" + strings.TrimPrefix(url, "http://"); where != want {
		t.Errorf("console,otlp: the provider says %q, want %q (no password)", where, want)
	}

	t.Setenv("OTEL_TRACES_EXPORTER", "zipkin")
	var u *usageError
	if _, _, err := tracerProvider(ctx, os.Getenv, io.Discard); !errors.As(err, &u) || !strings.Contains(err.Error(), `"console"`) {
		t.Fatalf("OTEL_TRACES_EXPORTER=zipkin: %v, want a usage error naming \"otlp\" and \"console\"", err)
	}
}
