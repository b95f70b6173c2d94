// Command grpcupstream is the gRPC origin of bench/clients.sh: the standard
// health service (grpc.health.v1.Health/Check, a unary call with a tiny
// answer, what ghz loads) and server reflection (so ghz needs no .proto),
// served as plaintext HTTP/2 (h2c) on a loopback address.
package main

import (
	"flag"
	"log"
	"net"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/reflection"
)

func main() {
	listen := flag.String("listen", "127.0.0.1:0", "loopback address to serve on")
	flag.Parse()
	host, _, err := net.SplitHostPort(*listen)
	if err != nil || !(host == "127.0.0.1" || host == "::1" || strings.HasPrefix(host, "127.")) {
		log.Fatalf("grpcupstream: -listen %q: a loopback address is required", *listen)
	}
	lis, err := net.Listen("tcp", *listen)
	if err != nil {
		log.Fatalf("grpcupstream: %v", err)
	}
	srv := grpc.NewServer()
	healthpb.RegisterHealthServer(srv, health.NewServer()) // "" reports SERVING
	reflection.Register(srv)
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGINT, syscall.SIGTERM)
	go func() { <-stop; srv.Stop() }()
	log.Printf("grpcupstream: serving on %s", lis.Addr())
	if err := srv.Serve(lis); err != nil {
		log.Fatalf("grpcupstream: %v", err)
	}
}
