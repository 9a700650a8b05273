package main

import (
	"context"
	"fmt"
	"io"
	"net/url"
	"strings"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/exporters/stdout/stdouttrace"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
)

// tracing is the relay's tracer provider with a description of where its
// spans go, which the relay's "starting" line shows (relay reads it as a
// fmt.Stringer): "otlp-http <endpoint>", "otlp-grpc <endpoint>", "console
// (stderr)", or several of them.
type tracing struct {
	trace.TracerProvider
	where string
}

func (t tracing) String() string { return t.where }

// tracerProvider sets up the relay's tracing from OpenTelemetry's standard
// variables, read through getenv. OTEL_TRACES_EXPORTER, a comma list,
// chooses the exporters:
//
//   - "otlp": spans go over OTLP, by OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL,
//     "http/protobuf" (the default) or "grpc", to
//     OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT (the exporters' default,
//     localhost:4318 or :4317, when unset); the exporters read the rest
//     (headers, timeout, TLS, ...);
//   - "console": each span as a JSON line on stderr (stdouttrace), written
//     when it ends, beside the logs on stdout;
//   - "none": no spans.
//
// Unset, it is "otlp" when an OTLP endpoint is set, and "none" otherwise.
// OTEL_SDK_DISABLED=true turns tracing off whatever the rest says. The SDK
// reads OTEL_TRACES_SAMPLER(_ARG), OTEL_BSP_* and OTEL_SERVICE_NAME /
// OTEL_RESOURCE_ATTRIBUTES (the service name defaults to "stagedrain").
//
// It returns nil when tracing is off: the relay then makes no spans at all.
// shutdown flushes the spans still queued; call it when the relay stops.
func tracerProvider(ctx context.Context, getenv func(string) string, stderr io.Writer) (tp *tracing, shutdown func(context.Context) error, err error) {
	if strings.EqualFold(strings.TrimSpace(getenv("OTEL_SDK_DISABLED")), "true") {
		return nil, nil, nil
	}
	endpoint := strings.TrimSpace(getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
	if endpoint == "" {
		endpoint = strings.TrimSpace(getenv("OTEL_EXPORTER_OTLP_ENDPOINT"))
	}
	var exporters []string
	for _, e := range strings.Split(getenv("OTEL_TRACES_EXPORTER"), ",") {
		if e = strings.ToLower(strings.TrimSpace(e)); e != "" && e != "none" {
			exporters = append(exporters, e)
		}
	}
	if strings.TrimSpace(getenv("OTEL_TRACES_EXPORTER")) == "" && endpoint != "" {
		exporters = []string{"otlp"}
	}
	if len(exporters) == 0 {
		return nil, nil, nil
	}

	var opts []sdktrace.TracerProviderOption
	var where []string
	var made []sdktrace.SpanExporter
	fail := func(err error) (*tracing, func(context.Context) error, error) {
		for _, e := range made {
			_ = e.Shutdown(ctx)
		}
		return nil, nil, err
	}
	for _, name := range exporters {
		switch name {
		case "otlp":
			exp, desc, err := otlpExporter(ctx, getenv, endpoint)
			if err != nil {
				return fail(err)
			}
			made = append(made, exp)
			opts = append(opts, sdktrace.WithBatcher(exp))
			where = append(where, desc)
		case "console":
			exp, err := stdouttrace.New(stdouttrace.WithWriter(stderr))
			if err != nil {
				return fail(fmt.Errorf("run: set up the console trace exporter: %w", err))
			}
			made = append(made, exp)
			// Each span as it ends: a user watching sees it at once.
			opts = append(opts, sdktrace.WithSyncer(exp))
			where = append(where, "console (stderr)")
		default:
			return fail(usagef("run: OTEL_TRACES_EXPORTER %q: stagedrain exports traces to \"otlp\" or \"console\" (or \"none\")", name))
		}
	}
	// Later options win: the environment's service name over the default.
	res, err := resource.New(ctx, resource.WithAttributes(attribute.String("service.name", "stagedrain")),
		resource.WithTelemetrySDK(), resource.WithFromEnv())
	if err != nil {
		return fail(fmt.Errorf("run: tracing resource: %w", err))
	}
	sdk := sdktrace.NewTracerProvider(append(opts, sdktrace.WithResource(res))...)
	return &tracing{TracerProvider: sdk, where: strings.Join(where, ", ")}, sdk.Shutdown, nil
}

// otlpExporter makes the OTLP exporter of OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL,
// and says where it sends: "otlp-http <endpoint>" or "otlp-grpc <endpoint>".
func otlpExporter(ctx context.Context, getenv func(string) string, endpoint string) (sdktrace.SpanExporter, string, error) {
	protocol := getenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
	if protocol == "" {
		protocol = getenv("OTEL_EXPORTER_OTLP_PROTOCOL")
	}
	var exp sdktrace.SpanExporter
	var err error
	var desc string
	switch strings.TrimSpace(protocol) {
	case "", "http/protobuf":
		exp, err = otlptracehttp.New(ctx)
		desc = "otlp-http " + describeEndpoint(endpoint, "localhost:4318")
	case "grpc":
		exp, err = otlptracegrpc.New(ctx)
		desc = "otlp-grpc " + describeEndpoint(endpoint, "localhost:4317")
	default:
		return nil, "", usagef("run: OTEL_EXPORTER_OTLP_PROTOCOL %q: stagedrain exports traces over \"http/protobuf\" or \"grpc\"", protocol)
	}
	if err != nil {
		return nil, "", fmt.Errorf("run: set up the OTLP trace exporter: %w", err)
	}
	return exp, desc, nil
}

// describeEndpoint is an OTLP endpoint for a log line: without a user,
// password or query, which may hold a secret; def when it is unset.
func describeEndpoint(endpoint, def string) string {
	if endpoint == "" {
		return def
	}
	u, err := url.Parse(endpoint)
	if err != nil || u.Host == "" {
		if strings.ContainsAny(endpoint, "@?") {
			return "(an endpoint that is not a URL)"
		}
		return endpoint
	}
	u.User, u.RawQuery, u.Fragment = nil, "", ""
	return u.String()
}
