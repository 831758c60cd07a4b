# What `cmake --install` puts under the prefix: the headers (include/ferry/<folder>/*.h, the same
# paths the sources include), the static libraries, the `ferry` tool, a CMake package (ferry::ferry
# and one target per library, lib/cmake/ferry) and ferry.pc. Under scikit-build-core (`pip install .`)
# only the Python package and the `ferry` command (component python, see pyproject.toml).
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

if(SKBUILD)
  if(NOT FERRY_HAVE_PYTHON)
    message(FATAL_ERROR "pip install needs Python development headers and pybind11")
  endif()
  install(TARGETS ferry_python LIBRARY DESTINATION ferry COMPONENT python)
  install(TARGETS ferry RUNTIME DESTINATION ${SKBUILD_SCRIPTS_DIR} COMPONENT python)
  return()
endif()

# The libraries in link order (each before those it uses), as ferry.pc lists them. The trainer's
# side (ferry_trainer, ferry_dataplane_send) links no reload code.
set(FERRY_INSTALL_LIBRARIES ferry_trainer ferry_rollout ferry_control ferry_dataplane_send ferry_dataplane_receive
    ferry_bucket_format ferry_reload ferry_transport ferry_sharding ferry_kernels ferry_core ferry_proto)
# Umbrellas without code of their own: ferry::coordinator (both faces) and ferry::dataplane (both ends).
set(FERRY_INSTALL_UMBRELLAS ferry_coordinator ferry_dataplane)
set(FERRY_INCLUDE_FOLDERS core kernels transport sharding reload dataplane coordinator)

# ferry::ferry: everything a program needs to use the Trainer and the RolloutWorker. The libraries
# are built with the sanitizers of this build; a program linking them needs their runtimes.
add_library(ferry_package INTERFACE)
set_target_properties(ferry_package PROPERTIES EXPORT_NAME ferry)
target_link_libraries(ferry_package INTERFACE ferry_coordinator)
target_compile_features(ferry_package INTERFACE cxx_std_20)
set(FERRY_SANITIZER_FLAGS "")
if(FERRY_SANITIZE)
  set(FERRY_SANITIZER_FLAGS -fsanitize=address,undefined)
elseif(FERRY_TSAN)
  set(FERRY_SANITIZER_FLAGS -fsanitize=thread)
endif()
target_link_options(ferry_package INTERFACE ${FERRY_SANITIZER_FLAGS})

foreach(lib ${FERRY_INSTALL_LIBRARIES} ${FERRY_INSTALL_UMBRELLAS} ferry_xxhash ferry_zstd)
  string(REGEX REPLACE "^ferry_" "" short ${lib})
  set_target_properties(${lib} PROPERTIES EXPORT_NAME ${short})
endforeach()
install(TARGETS ${FERRY_INSTALL_LIBRARIES} ${FERRY_INSTALL_UMBRELLAS} ferry_xxhash ferry_zstd ferry_package EXPORT ferryTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/ferry)
install(TARGETS ferry RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})

foreach(folder ${FERRY_INCLUDE_FOLDERS})
  install(DIRECTORY ${PROJECT_SOURCE_DIR}/${folder} DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/ferry
          FILES_MATCHING PATTERN "*.h")
endforeach()
install(FILES ${PROJECT_BINARY_DIR}/proto/ferry.pb.h DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/ferry/proto)

set(FERRY_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/ferry)
install(EXPORT ferryTargets NAMESPACE ferry:: DESTINATION ${FERRY_CMAKE_DIR})
configure_package_config_file(${CMAKE_CURRENT_LIST_DIR}/ferryConfig.cmake.in ${PROJECT_BINARY_DIR}/ferryConfig.cmake
                              INSTALL_DESTINATION ${FERRY_CMAKE_DIR})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/ferryConfigVersion.cmake COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/ferryConfig.cmake ${PROJECT_BINARY_DIR}/ferryConfigVersion.cmake
        DESTINATION ${FERRY_CMAKE_DIR})

# ferry.pc: the same libraries and dependencies for builds without CMake; relocatable like the package.
file(RELATIVE_PATH FERRY_PC_PREFIX_FROM_PCFILEDIR /root/${CMAKE_INSTALL_LIBDIR}/pkgconfig /root)
string(REGEX REPLACE "/$" "" FERRY_PC_PREFIX_FROM_PCFILEDIR ${FERRY_PC_PREFIX_FROM_PCFILEDIR})
list(TRANSFORM FERRY_INSTALL_LIBRARIES PREPEND -l OUTPUT_VARIABLE FERRY_PC_LIBS)
list(JOIN FERRY_PC_LIBS " " FERRY_PC_LIBS)
set(FERRY_PC_REQUIRES "protobuf spdlog fmt nlohmann_json libcrypto libxxhash libzstd")
set(FERRY_PC_CFLAGS "")
set(FERRY_PC_EXTRA_LIBS "-lrt -pthread ${FERRY_SANITIZER_FLAGS}")
if(FERRY_HAVE_UCX)
  string(APPEND FERRY_PC_REQUIRES " ucx")
endif()
if(FERRY_HAVE_CUDA)
  list(JOIN CUDAToolkit_INCLUDE_DIRS " -I" cuda_includes)
  set(FERRY_PC_CFLAGS "-DFERRY_HAVE_CUDA=1 -I${cuda_includes}")
  string(PREPEND FERRY_PC_EXTRA_LIBS "-L${CUDAToolkit_LIBRARY_DIR} -lcudart ")
endif()
if(FERRY_HAVE_NCCL)
  string(PREPEND FERRY_PC_EXTRA_LIBS "${NCCL_LIBRARY} ")
endif()
configure_file(${CMAKE_CURRENT_LIST_DIR}/ferry.pc.in ${PROJECT_BINARY_DIR}/ferry.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/ferry.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
