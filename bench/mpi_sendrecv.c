/* The OpenMPI baseline of `ferry bench transport`: rank 0 sends ITERS messages of BYTES to rank 1
 * and prints the seconds per message once rank 1 has received them all. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (argc < 3) {
    if (rank == 0) fprintf(stderr, "usage: mpi_sendrecv BYTES ITERS\n");
    MPI_Finalize();
    return 2;
  }
  const long long bytes = atoll(argv[1]);
  const int iters = atoi(argv[2]);
  char* buf = malloc(bytes > 0 ? (size_t)bytes : 1);
  memset(buf, rank + 1, bytes > 0 ? (size_t)bytes : 1);
  const int count = (int)(bytes > 0x7fffffff ? 0x7fffffff : bytes);
  char ack = 0;
  for (int pass = 0; pass < 2; ++pass) { /* pass 0 warms up the connection */
    const int n = pass == 0 ? 1 : iters;
    MPI_Barrier(MPI_COMM_WORLD);
    const double t0 = MPI_Wtime();
    for (int i = 0; i < n; ++i) {
      if (rank == 0) MPI_Send(buf, count, MPI_BYTE, 1, 0, MPI_COMM_WORLD);
      else MPI_Recv(buf, count, MPI_BYTE, 0, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    }
    if (rank == 1) MPI_Send(&ack, 1, MPI_BYTE, 0, 1, MPI_COMM_WORLD);
    else MPI_Recv(&ack, 1, MPI_BYTE, 1, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    const double t1 = MPI_Wtime();
    if (rank == 0 && pass == 1) printf("seconds %.9f bytes %d\n", (t1 - t0) / n, count);
  }
  free(buf);
  MPI_Finalize();
  return 0;
}
